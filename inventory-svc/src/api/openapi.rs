//! `GET /openapi.json`: the API as an OpenAPI 3.1 document, generated from the handlers'
//! `#[utoipa::path]` annotations and the body types' `ToSchema` derives.
//!
//! `docs/openapi.json` is this document, checked in; `tests/openapi.rs` fails when they differ and
//! rewrites it with `KVROUTE_WRITE_OPENAPI=1 cargo test -p kvroute-inventory --test openapi`.

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

/// The document's root: every route of [`super::router`] and the body types they reference.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "kvroute-inventory",
        description = "KV-cache-aware routing service: routing decisions for the Envoy filter, hash contracts, staged tokenizers, the loxilb-shaped rule management API, the block inventory and probes. Every error answer carries an `ErrorBody`.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    paths(
        super::route::route,
        super::outcomes,
        super::tenants,
        super::list_contracts,
        super::contract,
        super::tokenizers::tokenizer_json,
        super::tokenizers::tokenizer_file,
        super::add_rule,
        super::list_rules,
        super::delete_rule,
        super::inventory,
        super::healthz,
        super::readyz,
        super::metrics,
        openapi_json,
    ),
    components(schemas(super::error::ErrorBody)),
    modifiers(&SecuritySchemes),
    tags(
        (name = "routing", description = "Asked by the filter"),
        (name = "tokenizers", description = "Staged tokenizers served to the filter"),
        (name = "management", description = "Rules (loxilb API shape) and the block inventory"),
        (name = "probes", description = "Health, readiness, metrics and this document"),
    ),
)]
pub struct ApiDoc;

/// Adds the two bearer schemes the routes refer to.
struct SecuritySchemes;

impl Modify for SecuritySchemes {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "management_token",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "The token in `--auth-token-file`; required for rule writes (without the flag every write is refused).",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "route_token",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "The token in `--route-token-file`; `POST /v1/route` and `POST /v1/rules/{id}/outcomes` are open without the flag.",
                    ))
                    .build(),
            ),
        );
    }
}

/// The document as pretty JSON with a trailing newline (the checked-in file's exact bytes).
pub fn document_json() -> Result<String, serde_json::Error> {
    ApiDoc::openapi().to_pretty_json().map(|s| s + "\n")
}

#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "probes",
    summary = "This document",
    responses((status = 200, description = "OpenAPI 3.1 document", content_type = "application/json", body = Object)),
)]
pub async fn openapi_json() -> Response {
    match document_json() {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => super::error::ApiError::Internal(e.to_string()).into_response(),
    }
}
