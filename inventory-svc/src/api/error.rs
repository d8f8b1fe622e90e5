//! The one error type every handler returns: a stable status and message, details logged once.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use kvroute_core::rule::FieldError;

/// The body of every error answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong, e.g. `missing or wrong bearer token`.
    pub error: String,
    /// Every rejected field of an invalid rule (only on `invalid rule`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problems: Option<Vec<FieldError>>,
}

/// Errors the HTTP API answers with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("malformed JSON body: {0}")]
    BadJson(String),
    #[error("invalid rule")]
    InvalidRule(Vec<FieldError>),
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("missing or wrong bearer token")]
    Unauthorized,
    #[error("{0}")]
    NotFound(String),
    #[error("rule {0} already exists")]
    Conflict(String),
    #[error("no healthy endpoint for rule {0}")]
    NoEndpoint(String),
    #[error("internal error")]
    Internal(String),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            ApiError::BadJson(_) | ApiError::InvalidRule(_) | ApiError::BadRequest(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::NoEndpoint(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let problems = match &self {
            ApiError::InvalidRule(p) => Some(p.clone()),
            ApiError::Internal(detail) => {
                tracing::error!("internal error: {detail}");
                None
            }
            _ => None,
        };
        let body = ErrorBody {
            error: self.to_string(),
            problems,
        };
        let mut resp = (status, Json(body)).into_response();
        if matches!(self, ApiError::Unauthorized) {
            if let Ok(v) = "Bearer".parse() {
                resp.headers_mut()
                    .insert(axum::http::header::WWW_AUTHENTICATE, v);
            }
        }
        resp
    }
}

/// Parses a JSON body, turning any serde error into a 400.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::BadJson(e.to_string()))
}
