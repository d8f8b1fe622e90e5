//! Validation errors of rules, process settings and the filter's plugin configuration: one
//! [`FieldError`] per bad field, all of them collected so a caller fixes a configuration in one
//! round trip.

use std::fmt;

/// One rejected field: its name, the value as received, and what would have been accepted.
///
/// `field` is the JSON name (`kvBlockSize`, `endpoints[1].targetPort`) or the environment variable;
/// `value` is rendered as JSON (`16`, `"xxhash_cbor"`) or [`MISSING`]. It is also what the
/// inventory's API answers for every rejected field (`problems` of an `invalid rule` body) and
/// what the filter reports for its plugin configuration.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, thiserror::Error)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[error("{field}: got {value}, allowed: {allowed}")]
pub struct FieldError {
    pub field: String,
    pub value: String,
    pub allowed: String,
}

/// How [`FieldError::value`] shows a required field that was not given.
pub const MISSING: &str = "(missing)";

impl FieldError {
    /// Builds an error from anything string-like.
    pub fn new(
        field: impl Into<String>,
        value: impl Into<String>,
        allowed: impl Into<String>,
    ) -> Self {
        FieldError {
            field: field.into(),
            value: value.into(),
            allowed: allowed.into(),
        }
    }
}

/// Renders a received string the way error messages show it: JSON-quoted and escaped.
pub fn quoted(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

/// Writes `what (n errors): e1; e2; ...` (shared with [`crate::settings::SettingsErrors`]).
pub(crate) fn write_list(
    f: &mut fmt::Formatter<'_>,
    what: &str,
    errors: &[FieldError],
) -> fmt::Result {
    let n = errors.len();
    write!(f, "{what} ({n} error{}): ", if n == 1 { "" } else { "s" })?;
    for (i, e) in errors.iter().enumerate() {
        if i > 0 {
            f.write_str("; ")?;
        }
        write!(f, "{e}")?;
    }
    Ok(())
}

/// Every reason a rule was rejected, in field order. Never empty.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct RuleErrors(pub Vec<FieldError>);

impl fmt::Display for RuleErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_list(f, "invalid rule", &self.0)
    }
}

impl RuleErrors {
    /// The rejected fields' names, in order (handy for assertions and logs).
    pub fn fields(&self) -> Vec<&str> {
        self.0.iter().map(|e| e.field.as_str()).collect()
    }
}

/// A rule body that failed either as JSON (wrong type, unknown field: serde stops at the first)
/// or as a rule (every bad value at once).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RuleParseError {
    #[error("rule body is not a valid loadbalancer entry: {0}")]
    Json(String),
    #[error(transparent)]
    Invalid(#[from] RuleErrors),
}

/// Accumulates field errors during one validation pass.
#[derive(Default)]
pub(crate) struct Collector(pub(crate) Vec<FieldError>);

impl Collector {
    pub(crate) fn push(
        &mut self,
        field: impl Into<String>,
        value: impl Into<String>,
        allowed: impl Into<String>,
    ) {
        self.0.push(FieldError::new(field, value, allowed));
    }

    /// An integer field: `default` when absent, `None` (and an error) when outside `min..=max`.
    pub(crate) fn int<T: TryFrom<i64>>(
        &mut self,
        field: &str,
        raw: Option<i64>,
        default: T,
        range: (i64, i64),
        allowed: &str,
    ) -> Option<T> {
        match raw {
            None => Some(default),
            Some(_) => self.required_int(field, raw, range, allowed),
        }
    }

    /// An integer field with only a lower bound in the issue (`>= min`); the upper end is the
    /// storage type's limit `max` and gets its own message.
    pub(crate) fn at_least<T: TryFrom<i64>>(
        &mut self,
        field: &str,
        raw: Option<i64>,
        default: T,
        min: i64,
        max: i64,
    ) -> Option<T> {
        match raw {
            None => Some(default),
            Some(v) if v < min => {
                self.push(field, v.to_string(), format!(">= {min}"));
                None
            }
            Some(_) => self.required_int(field, raw, (min, max), &format!("<= {max}")),
        }
    }

    /// A required integer field: an error naming [`MISSING`] when absent.
    pub(crate) fn required_int<T: TryFrom<i64>>(
        &mut self,
        field: &str,
        raw: Option<i64>,
        (min, max): (i64, i64),
        allowed: &str,
    ) -> Option<T> {
        let Some(v) = raw else {
            self.push(field, MISSING, allowed);
            return None;
        };
        if (min..=max).contains(&v) {
            if let Ok(t) = T::try_from(v) {
                return Some(t);
            }
        }
        self.push(field, v.to_string(), allowed);
        None
    }
}
