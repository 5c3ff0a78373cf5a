"""API keys on the gRPC port, checked at the metadata, before a call's message is read (issue 53).

grpc.aio runs a server's interceptors once a call's metadata has arrived, before its request message is received; a
unary handler is then handed the whole message, received and deserialized, before it runs. So a key checked inside
ModelInfer came after up to max_receive_message_length bytes of each call: 600 unauthenticated 2.1 MB calls (200 at
once) took a front end from 177 MB to 703 MB, and it stayed at 622 MB. Here a call without a valid key is answered
by a stream-unary handler that aborts without reading its request stream: the message is never received, copied or
deserialized, and gRPC's HTTP/2 flow control leaves at most a window of it (64 KiB per stream, grpcio's default
start) in flight.

Which calls need a key, with keys on: ModelInfer always; ModelStatistics and ModelConfig as their REST routes do
(auth.needs_key: unless FUSEDSERVE_PUBLIC_API opens them, or a FUSEDSERVE_RESTRICTED_API header guards them, which
auth.grpc_interceptor checks). Health and metadata stay open, as over REST. The refusal is UNAUTHENTICATED, counted
`unauthorized` for ModelInfer (protocol v2_grpc) as before, with the call's x-request-id in the trailing metadata.

Refusals held: grpcio gives a handler no way to close its connection, so a client that sends calls without a key as
fast as they are refused comes back at once (the attack benchmark's 64 calls in flight on one TLS connection: 110-160
refusals a second, ~0.7 ms of the front end's core each). Each client address gets REFUSE_BURST refusals at once and
then REFUSE_RATE a second (a token bucket per address, as the HTTP side's connect rate: a client with a wrong key
sees its error at once); past that a refusal is held REFUSE_HOLD_S before its answer, unread, so that such a client
gets one refusal a second per call it keeps in flight. At most REFUSED_HELD_MAX are held at once, all addresses
together (each may hold a stream's window, 64 KiB, in grpcio's buffers: 16 MB); past it a refusal is answered at once.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from ..frontend import requestid
from ..frontend.accept import ConnectRate
from ..frontend.auth import GRPC_APIS, needs_key

INFER = "/inference.GRPCInferenceService/ModelInfer"
PROTOCOL = "v2_grpc"
MESSAGE = "a valid API key is needed: metadata authorization: Bearer <key>"

REFUSE_BURST, REFUSE_RATE = 20, 10.0  # refusals an address gets at once, then a second, before they are held
REFUSE_HOLD_S = 1.0
REFUSED_HELD_MAX = 256


def keys_interceptor(state):
    """A grpc.aio server interceptor that refuses the calls needing a key (module docstring) without a valid one;
    None when no key setting is given at start (no interceptor, no cost per call: ModelInfer still checks the key
    itself, for keys a reload turns on later)."""
    s = state.settings
    if s.api_key is None and s.api_keys_file is None:
        return None
    public = s.public_apis()

    class Keys(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            keys = state.api_keys
            method = details.method
            if keys.digests is None:
                return await continuation(details)
            if method != INFER and not needs_key(GRPC_APIS.get(method), state.restrictions, public):
                return await continuation(details)
            metadata = details.invocation_metadata or ()
            if keys.allows(next((v for k, v in metadata if k == "authorization"), None)):
                return await continuation(details)
            rid = next((v for k, v in metadata if k == "x-request-id" and requestid.valid(v)), None)
            if method == INFER:
                state.metrics.observe_request("unauthorized", protocol=PROTOCOL)
            return _refusal(rid, pace)

    pace = RefusalPace()
    return Keys()


class RefusalPace:
    """Which refusals wait (module docstring): a token bucket per client address, and the count held now."""

    def __init__(self, burst: int = REFUSE_BURST, rate: float = REFUSE_RATE, held_max: int = REFUSED_HELD_MAX):
        self.bucket = ConnectRate(rate, burst)
        self.held = 0
        self.held_max = held_max

    def hold(self, peer: str) -> bool:
        """Whether a refusal for `peer` (grpc's context.peer(): "ipv4:1.2.3.4:5678", "ipv6:[::1]:5678") is held:
        its address is past its refusals at once and fewer than held_max are held."""
        ip = peer.rpartition(":")[0] if peer.startswith(("ipv4:", "ipv6:")) else peer
        return not self.bucket.take(ip, time.monotonic()) and self.held < self.held_max


def _refusal(rid: str | None, pace: RefusalPace):
    async def refuse(request_iterator, context):  # the request stream is never read
        context.set_trailing_metadata((("x-request-id", rid or requestid.new().decode()),))
        if pace.hold(context.peer()):
            pace.held += 1
            try:
                await asyncio.sleep(REFUSE_HOLD_S)
            finally:
                pace.held -= 1
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)

    return grpc.stream_unary_rpc_method_handler(refuse)
