//! One-shot HTTP helpers: a request, its status and its body, with a bounded timeout.

use std::time::Duration;

use anyhow::Result;
use serde_json::Value;

/// How long one helper request may take.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// `GET url`: (status, body).
pub async fn get(url: &str) -> Result<(u16, String)> {
    answer(reqwest::Client::new().get(url)).await
}

/// `POST url` with `body` as JSON: (status, body).
pub async fn post_json(url: &str, body: &Value) -> Result<(u16, String)> {
    answer(reqwest::Client::new().post(url).json(body)).await
}

/// Sends `req` (bounded by [`TIMEOUT`]): (status, body).
pub async fn answer(req: reqwest::RequestBuilder) -> Result<(u16, String)> {
    let r = req.timeout(TIMEOUT).send().await?;
    let status = r.status().as_u16();
    Ok((status, r.text().await?))
}
