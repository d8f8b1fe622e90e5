//! `GET /v1/tokenizers/{slug}` and `GET /v1/tokenizers/{slug}/tokenizer_config.json`: staged
//! tokenizers served to filters from `<dir>/tokenizers/<slug>/`.
//!
//! The slug is the model name with `/` replaced by `__` (kvroute-core `slug`); a path segment that
//! is not a valid slug is rejected before touching the filesystem, so no request escapes the dir.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::ApiState;

/// Files a filter may fetch per tokenizer.
const FILES: &[&str] = &["tokenizer.json", "tokenizer_config.json"];

fn valid_segment(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

async fn serve(state: &ApiState, slug: &str, file: &str) -> Result<Response, ApiError> {
    let dir = state.fleet.tokenizer_dir().ok_or_else(|| {
        ApiError::NotFound("no tokenizer directory configured (--tokenizer-dir)".into())
    })?;
    if !valid_segment(slug) || !FILES.contains(&file) {
        return Err(ApiError::NotFound(format!(
            "tokenizer {slug:?}/{file:?}: no such file (allowed: {})",
            FILES.join(", ")
        )));
    }
    let path = dir.join("tokenizers").join(slug).join(file);
    match tokio::fs::read(&path).await {
        Ok(bytes) => Ok(([(header::CONTENT_TYPE, "application/json")], bytes).into_response()),
        Err(_) => Err(ApiError::NotFound(format!(
            "tokenizer {slug:?} not staged: {} is missing",
            path.display()
        ))),
    }
}

/// `tokenizer.json` of a slug.
#[utoipa::path(
    get,
    path = "/v1/tokenizers/{slug}",
    tag = "tokenizers",
    summary = "Staged tokenizer.json of a model slug",
    params(("slug" = String, Path, description = "Model name with `/` replaced by `__`")),
    responses(
        (status = 200, description = "The staged `tokenizer.json`", content_type = "application/json", body = Object),
        (status = 404, description = "No tokenizer directory, invalid slug or not staged", body = super::error::ErrorBody),
    ),
)]
pub async fn tokenizer_json(
    State(state): State<Arc<ApiState>>,
    Path(slug): Path<String>,
) -> Result<Response, ApiError> {
    serve(&state, &slug, "tokenizer.json").await
}

/// Another staged file of a slug (`tokenizer_config.json`).
#[utoipa::path(
    get,
    path = "/v1/tokenizers/{slug}/{file}",
    tag = "tokenizers",
    summary = "Another staged file of a model slug",
    params(
        ("slug" = String, Path, description = "Model name with `/` replaced by `__`"),
        ("file" = String, Path, description = "`tokenizer.json` or `tokenizer_config.json`"),
    ),
    responses(
        (status = 200, description = "The staged file", content_type = "application/json", body = Object),
        (status = 404, description = "No tokenizer directory, invalid slug or file, or not staged", body = super::error::ErrorBody),
    ),
)]
pub async fn tokenizer_file(
    State(state): State<Arc<ApiState>>,
    Path((slug, file)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    serve(&state, &slug, &file).await
}
