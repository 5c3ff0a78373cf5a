"""/docs (Swagger UI) and /redoc, each loading an exact version of its script from the CDN with its Subresource
Integrity hash, so that a browser runs those bytes or nothing (issue 53).

FastAPI's own pages load `swagger-ui-dist@5` and `redoc@2`: whatever the CDN serves as the newest 5.x or 2.x that day,
without integrity, plus a favicon from fastapi.tiangolo.com and fonts from Google. A page that holds a bearer key the
user types in should run only reviewed code. The hashes are sha384 of the files in the npm packages, which the CDN
serves byte for byte (`npm pack swagger-ui-dist@5.35.0 redoc@2.5.4`, then
`openssl dgst -sha384 -binary FILE | base64`); tests/test_attacks.py checks that every script and stylesheet of both
pages is pinned and carries one. The favicon is an empty data URL and ReDoc's fonts are its fallbacks: nothing else is
fetched.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse

CDN = "https://cdn.jsdelivr.net/npm/"
SWAGGER_JS = CDN + "swagger-ui-dist@5.35.0/swagger-ui-bundle.js"
SWAGGER_CSS = CDN + "swagger-ui-dist@5.35.0/swagger-ui.css"
REDOC_JS = CDN + "redoc@2.5.4/bundles/redoc.standalone.js"
INTEGRITY = {
    SWAGGER_JS: "sha384-gjRm0bEPMeTmMh5jT2cHccIwCUZSTd8YC+j0d0sXw0MdGEfScduGpSyF3ZSSLkX9",
    SWAGGER_CSS: "sha384-WlYgdmXYOOBWL5apwjDEZwN+U3HmXSSu5R6V5aGxEcf7z+KuRNwBhoxKVN1i3D5I",
    REDOC_JS: "sha384-w447zOpYfw/1Tv/5AK9NfHTlQIqE3RVR6KY62jCyy9zNDgO64cMwGGP1Fj0zJVf5",
}
NO_FAVICON = "data:,"
OPENAPI_URL = "/openapi.json"
OAUTH2_REDIRECT = "/docs/oauth2-redirect"


def _pinned(page: HTMLResponse) -> HTMLResponse:
    html = page.body.decode()
    for url, digest in INTEGRITY.items():
        attr = "href" if url.endswith(".css") else "src"
        html = html.replace(f'{attr}="{url}"', f'{attr}="{url}" integrity="{digest}" crossorigin="anonymous"')
    return HTMLResponse(html)


def install(app: FastAPI) -> None:
    """/docs, its OAuth2 redirect page and /redoc on `app` (made with docs_url=None and redoc_url=None)."""

    async def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return _pinned(get_swagger_ui_html(
            openapi_url=root + OPENAPI_URL, title=f"{app.title} - Swagger UI", swagger_js_url=SWAGGER_JS,
            swagger_css_url=SWAGGER_CSS, swagger_favicon_url=NO_FAVICON, oauth2_redirect_url=root + OAUTH2_REDIRECT,
        ))  # fmt: skip

    async def oauth2_redirect(request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return _pinned(get_redoc_html(
            openapi_url=root + OPENAPI_URL, title=f"{app.title} - ReDoc", redoc_js_url=REDOC_JS,
            redoc_favicon_url=NO_FAVICON, with_google_fonts=False,
        ))  # fmt: skip

    app.add_route("/docs", swagger, include_in_schema=False)
    app.add_route(OAUTH2_REDIRECT, oauth2_redirect, include_in_schema=False)
    app.add_route("/redoc", redoc, include_in_schema=False)
