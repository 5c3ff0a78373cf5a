"""Who may call what (docs/security.md): API keys for inference, a header for each restricted route, TLS files.

API keys. Inference (POST /predict, the v2 infer routes, gRPC ModelInfer) needs `Authorization: Bearer <key>` (gRPC
metadata `authorization`) once FUSEDSERVE_API_KEY or FUSEDSERVE_API_KEYS_FILE gives a key; without a valid one the
request gets 401 with `WWW-Authenticate: Bearer` (gRPC UNAUTHENTICATED), counted `unauthorized`, before its body is
read (service/frontend/serving.py, unauthorized). A keys file may hold `sha256:<hex>` lines instead of keys, so that
the secret mounted into the pod need not hold the keys themselves. Keys are never logged.

How a key is checked (`ApiKeys.allows`): the presented key's sha256 digest is looked up in a frozenset of the stored
keys' digests. One lookup whatever the number of keys (a compare_digest per stored key, as this did before, costs
~60 ns each: 60 us a request with 1,000 keys). Nothing in its time depends on a key's content, for two reasons. What is
hashed and compared is the digest of what the caller sent, which the caller cannot steer: even a timing that showed how
many leading bytes a stored digest shares with it would bring them no closer to a key (that takes a preimage of
sha256). And the set rarely compares digests at all: it places and finds them by Python's hash of their bytes, keyed by
a secret drawn at random when the process starts (SipHash), and compares bytes only where that 64-bit hash matches, so
which slot a probe visits tells the caller nothing either. A second keyed hash of the digest (an HMAC) before the
lookup would add ~0.35 us a request for no gain over these. What the time does show is whether the key matched, which
the answer says anyway.

Restricted routes (FUSEDSERVE_RESTRICTED_API, parsed in service/config.py): `api_of_path` names the API of a path,
by its shape rather than a list of routes, so that routes added later under the same shape (the statistics
extension's /v2/models[/NAME[/versions/V]]/stats) are covered the day they land; a request without the API's
header and value gets 403 (gRPC PERMISSION_DENIED, through `grpc_interceptor`). The values are compared in
constant time (their sha256 digests, by hmac.compare_digest).

Keys in force. The supervisor alone reads the keys file: at start and on SIGHUP (`ApiKeys.reload`). Every front end
holds the supervisor's digests, never the file's: a front end started (or started again, after a crash or an OOM kill)
gets them with its arguments (`ApiKeys.in_force`), and a SIGHUP that changes them publishes them in the run directory
(`write_keys_in_force`, mode 0600, written whole then renamed) before the new configuration generation is announced,
so that each front end takes the same set (`read_keys_in_force`, `ApiKeys.take`). So a keys file emptied or removed
by mistake, then a SIGHUP and a front-end restart, leave the last good keys in force everywhere (issue 53): the
restarted front end cannot read an empty file and serve open, nor fail to read a missing one and crash-loop.

Cost on the hot path with keys on: one scan of the request's headers, a sha256 of ~40 bytes and a set lookup, under half
a microsecond on a CI core whatever the number of keys; with keys off, one attribute test.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import ssl
from pathlib import Path

from ..config import ENV_PREFIX, KEYED_APIS, Settings

log = logging.getLogger(__name__)

SHA256 = "sha256:"
CHALLENGE = (b"www-authenticate", b"Bearer")
_BEARER = b"bearer "
_PRINTABLE = bytes(range(0x21, 0x7F))  # a key: printable ASCII, no spaces
# gRPC methods behind a restriction: Triton's statistics and model-configuration extensions.
GRPC_APIS = {
    "/inference.GRPCInferenceService/ModelStatistics": "statistics",
    "/inference.GRPCInferenceService/ModelConfig": "model-config",
}
_DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class SecurityFileError(ValueError):
    """A keys or TLS file (or key setting) cannot be used; the message names it (and the line), never a secret."""


def read_keys(settings: Settings) -> tuple[tuple[bytes, ...] | None, str]:
    """(the sha256 digests of every key, or None when no key is configured (inference open), where they come from).

    A keys file that holds no key leaves keys off only where API_KEY is unset too; the caller says so in the log.
    SecurityFileError for an unreadable file or a line that is not a key.
    """
    digests: list[bytes] = []
    sources = []
    if settings.api_key is not None:
        key = settings.api_key.get_secret_value().strip()
        if not key or key.encode().translate(None, _PRINTABLE):
            raise SecurityFileError(f"{ENV_PREFIX}API_KEY must be printable ASCII without spaces, not empty")
        digests.append(hashlib.sha256(key.encode()).digest())
        sources.append(f"{ENV_PREFIX}API_KEY")
    path = settings.api_keys_file
    if path is not None:
        from_file = _read_keys_file(Path(path))
        digests += from_file
        sources.append(f"{ENV_PREFIX}API_KEYS_FILE={path} ({len(from_file)})")
    if not digests:
        return None, " and ".join(sources)
    return tuple(dict.fromkeys(digests)), " and ".join(sources)


def _read_keys_file(path: Path) -> list[bytes]:
    var = f"{ENV_PREFIX}API_KEYS_FILE={path}"
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise SecurityFileError(f"{var}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise SecurityFileError(f"{var}: not UTF-8 text") from None
    digests = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(SHA256):
            hexdigest = line[len(SHA256) :].strip().lower()
            try:
                digest = bytes.fromhex(hexdigest)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise SecurityFileError(f"{var}, line {n}: sha256: must be followed by 64 hex digits")
            digests.append(digest)
            continue
        if line.encode().translate(None, _PRINTABLE):
            raise SecurityFileError(
                f"{var}, line {n}: a key must be printable ASCII without spaces (the line is not shown)"
            )
        digests.append(hashlib.sha256(line.encode()).digest())
    return digests


# The keys in force as the supervisor hands them to a front end: (the digests, or None: keys off; where they come from).
KeysInForce = tuple[frozenset[bytes] | None, str]


class ApiKeys:
    """The API keys in force. The supervisor's are read from the settings (`reload()` reads them again on SIGHUP); a
    front end's are the supervisor's (`in_force`), taken again at each reload (`take`), never read from the file."""

    def __init__(self, settings: Settings, in_force: KeysInForce | None = None):
        self.settings = settings
        self.digests: frozenset[bytes] | None = None  # the keys' sha256 digests; None: keys off
        self.source = ""
        if in_force is None:
            self.reload()
        else:
            self.take(in_force)

    @property
    def on(self) -> bool:
        return self.digests is not None

    def in_force(self) -> KeysInForce:
        """What a front end started now must hold: these digests, not whatever the keys file says by then."""
        return self.digests, self.source

    def take(self, in_force: KeysInForce) -> bool:
        """Hold the supervisor's keys (`in_force`); True if they differ from those held. Like `reload`, it tightens but
        never opens: keys off in place of keys on raises SecurityFileError and the keys held stay."""
        digests, source = in_force
        if digests is None and self.digests is not None:
            raise SecurityFileError(f"keys off would replace the {len(self.digests)} in force; they stay")
        digests = None if digests is None else frozenset(digests)
        changed = digests != self.digests
        self.digests, self.source = digests, source
        return changed

    def refuse_all(self) -> None:
        """Keys on, none valid: every inference request gets 401 (a front end that cannot take the supervisor's)."""
        self.digests, self.source = frozenset(), "no key (the supervisor's could not be taken)"

    def reload(self, settings: Settings | None = None) -> int:
        """Read the keys again (from `settings` when given: a reload that changed the configuration), and return
        how many there are. On SecurityFileError the keys in force stay. A reload tightens but never opens: once
        keys are on, a configuration or file that gives none raises SecurityFileError and the old keys stay
        (restart to turn keys off), so a file emptied by mistake cannot open the service."""
        settings = settings or self.settings
        digests, source = read_keys(settings)
        if digests is None and self.digests is not None:
            raise SecurityFileError(
                f"the new configuration ({source or 'no key setting'}) gives no API key; keeping the "
                f"{len(self.digests)} in force: restart the service to turn keys off"
            )
        self.settings, self.source = settings, source
        self.digests = None if digests is None else frozenset(digests)
        return len(digests or ())

    def allows(self, authorization: bytes | str | None) -> bool:
        """Whether an `Authorization` header (or gRPC metadata) value carries a valid key; True when keys are off.
        One set lookup, whatever the number of keys (the module's docstring says why its time shows nothing of them)."""
        digests = self.digests
        if digests is None:
            return True
        if authorization is None:
            return False
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1", "replace")
        if authorization[:7].lower() != _BEARER:
            return False
        return hashlib.sha256(authorization[7:].strip()).digest() in digests

    def describe(self) -> str:
        """One line for the start-up log: on or off, how many keys, from where; never a key."""
        if self.digests is None:
            if self.source:  # a keys file with no key in it
                return f"API keys off: {self.source} holds no key; inference is open to whoever reaches the port"
            return "API keys off (FUSEDSERVE_API_KEY and FUSEDSERVE_API_KEYS_FILE unset): inference is open"
        n = len(self.digests)
        return f"API keys on: {n} key{'s' if n != 1 else ''} from {self.source}; inference needs Authorization: Bearer"


KEYS_IN_FORCE_FILE = "api-keys.json"  # in the run directory (a private tempfile.mkdtemp, mode 0700)


def write_keys_in_force(run_dir: Path, generation: int, keys: ApiKeys) -> None:
    """Supervisor side: publish the digests of the keys in force as of configuration `generation`, for the front ends
    to take (`read_keys_in_force`): mode 0600, written whole, then renamed over the last. OSError if it cannot."""
    digests = None if keys.digests is None else sorted(d.hex() for d in keys.digests)
    doc = json.dumps({"generation": generation, "source": keys.source, "digests": digests})
    tmp = run_dir / (KEYS_IN_FORCE_FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, doc.encode())
    finally:
        os.close(fd)
    os.replace(tmp, run_dir / KEYS_IN_FORCE_FILE)


def read_keys_in_force(run_dir: Path) -> tuple[int, KeysInForce]:
    """Front end side: (generation, the supervisor's keys in force) as last published. OSError or ValueError (a file
    that is not one `write_keys_in_force` wrote) when it cannot."""
    doc = json.loads((run_dir / KEYS_IN_FORCE_FILE).read_bytes())
    try:
        digests = doc["digests"]
        if digests is not None:
            digests = frozenset(bytes.fromhex(d) for d in digests)
            if any(len(d) != 32 for d in digests):
                raise ValueError("a digest that is not 32 bytes")
        return int(doc["generation"]), (digests, str(doc["source"]))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{KEYS_IN_FORCE_FILE}: not the supervisor's keys ({type(e).__name__}: {e})") from None


def describe_access(settings: Settings, keys: ApiKeys) -> str:
    """The start-up log's one line on who may call what: keys (on or off, how many, never one), TLS, restricted
    routes, the metrics port, the docs."""
    parts = [keys.describe()]
    if settings.tls:
        parts.append("TLS on" + (" (client certificates required)" if settings.tls_client_ca else ""))
    else:
        parts.append("TLS off")
    restricted = sorted(settings.restrictions())
    if restricted:
        parts.append(f"restricted to a header: {', '.join(restricted)}")
    if settings.metrics_port is not None:
        parts.append(f"/metrics on port {settings.metrics_port} only")
    parts.append("docs on" if settings.docs else "docs off")
    return "; ".join(parts)


# ------------------------------------------------------------------ restricted routes


def api_of_path(path: str) -> str | None:
    """The restrictable API a request path belongs to, or None (inference, health, metadata: never restricted).
    /v2 paths by shape: a last segment `stats` is the statistics extension, `config` the model configuration."""
    if path.startswith("/v2/"):
        segments = [s for s in path.split("/") if s]
        if len(segments) >= 3 and segments[1] == "models":
            if segments[-1] == "stats":
                return "statistics"
            if segments[-1] == "config" and len(segments) >= 4:
                return "model-config"
        return None
    if path == "/metrics" or path == "/metrics/":
        return "metrics"
    if path == "/model" or path == "/model/":
        return "model"
    if path in _DOCS_PATHS:
        return "docs"
    return None


def needs_key(api: str | None, restrictions: Restrictions, public: frozenset[str]) -> bool:
    """Whether, with API keys on, a request to `api` (api_of_path's name) needs a valid key beside inference (issue
    53): docs, model, statistics and model-config (config.KEYED_APIS) do, unless FUSEDSERVE_PUBLIC_API opens them on
    purpose or a FUSEDSERVE_RESTRICTED_API header guards them instead (that header alone then decides)."""
    return api in KEYED_APIS and api not in public and restrictions.header_for(api) is None


class Restrictions:
    """FUSEDSERVE_RESTRICTED_API's rules: each API's header name and the sha256 of its value."""

    def __init__(self, rules: dict[str, tuple[str, bytes]]):
        self.rules = rules

    def __bool__(self) -> bool:
        return bool(self.rules)

    def header_for(self, api: str | None) -> str | None:
        rule = self.rules.get(api) if api is not None else None
        return rule[0] if rule else None

    def allows(self, api: str | None, value: bytes | str | None) -> bool:
        """Whether a request to `api` with its header's `value` (None: absent) may pass."""
        rule = self.rules.get(api) if api is not None else None
        if rule is None:
            return True
        if value is None:
            return False
        if isinstance(value, str):
            value = value.encode("latin-1", "replace")
        return hmac.compare_digest(hashlib.sha256(value.strip()).digest(), rule[1])

    def refusal(self, api: str) -> str:
        return f"{api} is restricted: send the {self.rules[api][0]} header with its value"


def grpc_interceptor(restrictions: Restrictions):
    """A grpc.aio server interceptor that refuses the restricted RPCs (GRPC_APIS) without their metadata, with
    PERMISSION_DENIED; None where no gRPC API is restricted (no interceptor, no cost per RPC)."""
    if not any(api in restrictions.rules for api in GRPC_APIS.values()):
        return None
    import grpc

    class Restricted(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            api = GRPC_APIS.get(details.method)
            header = restrictions.header_for(api)
            if header is None:
                return await continuation(details)
            value = next((v for k, v in details.invocation_metadata or () if k == header), None)
            if restrictions.allows(api, value):
                return await continuation(details)
            message = restrictions.refusal(api)

            async def deny(request, context):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

            return grpc.unary_unary_rpc_method_handler(deny)

    return Restricted()


# ------------------------------------------------------------------ TLS


def check_tls(settings: Settings) -> ssl.SSLContext | None:
    """The server's TLS context, built from the files as the front ends will (None without TLS): every file read
    now, so that one unreadable or not PEM stops the start with a SecurityFileError naming it, before any process
    starts."""
    if not settings.tls:
        return None
    files = {"TLS_CERT": settings.tls_cert, "TLS_KEY": settings.tls_key, "TLS_CLIENT_CA": settings.tls_client_ca}
    for name, path in files.items():
        if path is None:
            continue
        try:
            Path(path).read_bytes()
        except OSError as e:
            raise SecurityFileError(f"{ENV_PREFIX}{name}={path}: cannot read it: {e.strerror or e}") from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    except (ssl.SSLError, ValueError) as e:
        raise SecurityFileError(
            f"{ENV_PREFIX}TLS_CERT={settings.tls_cert} with {ENV_PREFIX}TLS_KEY={settings.tls_key}: not a PEM "
            f"certificate and its private key ({e})"
        ) from None
    if settings.tls_client_ca is not None:
        try:
            ctx.load_verify_locations(settings.tls_client_ca)
        except (ssl.SSLError, ValueError) as e:
            raise SecurityFileError(
                f"{ENV_PREFIX}TLS_CLIENT_CA={settings.tls_client_ca}: not PEM certificates ({e})"
            ) from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def grpc_credentials(settings: Settings):
    """grpc.ssl_server_credentials for the gRPC port (client certificates required with TLS_CLIENT_CA)."""
    import grpc

    ca = Path(settings.tls_client_ca).read_bytes() if settings.tls_client_ca is not None else None
    pair = (Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)
