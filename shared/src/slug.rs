//! Served model name -> directory name ("slug") under which its tokenizer lives.
//!
//! The mapping replaces every `/` with `__` (`Qwen/Qwen3-0.6B` -> `Qwen__Qwen3-0.6B`), so the
//! organisation/model layout of HuggingFace names becomes one flat directory level.
//!
//! Invariant: a [`ModelSlug`] is always a single, non-special path component. The name arrives in
//! rule configuration (and the filter may see it in request bodies), so anything that could
//! escape the tokenizer directory or confuse a filesystem is rejected instead of rewritten:
//! empty names, empty / `.` / `..` segments, a leading `/` (absolute path), backslashes
//! (Windows separators), NUL and other control characters, and slugs longer than one file name
//! may be ([`MAX_SLUG_BYTES`]).
//!
//! The mapping is not injective for names that already contain `__` (`a__b` and `a/b` share a
//! slug); serving two such models side by side would make them share a tokenizer directory.

use std::fmt;

/// What every `/` of a served model name becomes in its slug.
pub const SEPARATOR_REPLACEMENT: &str = "__";

/// Longest slug accepted, in bytes: the file-name limit (`NAME_MAX`) of common filesystems.
pub const MAX_SLUG_BYTES: usize = 255;

/// Why a served model name has no slug; each message names the offending input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlugError {
    #[error("model name is empty")]
    Empty,
    #[error("model name {name:?} starts with '/': absolute paths are not model names")]
    Absolute { name: String },
    #[error("model name {name:?} has an empty segment (\"//\" or a trailing '/')")]
    EmptySegment { name: String },
    #[error(
        "model name {name:?} has a {segment:?} segment, which would leave the tokenizer directory"
    )]
    DotSegment { name: String, segment: String },
    #[error("model name {name:?} contains a backslash")]
    Backslash { name: String },
    #[error("model name {name:?} contains NUL")]
    Nul { name: String },
    #[error("model name {name:?} contains the control character U+{code:04X}")]
    Control { name: String, code: u32 },
    #[error("model name {name:?} gives a slug of {len} bytes, longer than {max}", max = MAX_SLUG_BYTES)]
    TooLong { name: String, len: usize },
}

/// A validated served model name together with its slug.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ModelSlug {
    name: String,
    slug: String,
}

impl ModelSlug {
    /// Validates `name` and computes its slug.
    pub fn new(name: &str) -> Result<ModelSlug, SlugError> {
        Ok(ModelSlug {
            name: name.to_owned(),
            slug: slug(name)?,
        })
    }

    /// The served model name as configured (what clients put in `"model"`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The directory name: the model name with every `/` replaced by `__`.
    pub fn as_str(&self) -> &str {
        &self.slug
    }
}

impl fmt::Display for ModelSlug {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.slug)
    }
}

/// The slug of a served model name, or why the name cannot be one directory level.
pub fn slug(name: &str) -> Result<String, SlugError> {
    let owned = || name.to_owned();
    if name.is_empty() {
        return Err(SlugError::Empty);
    }
    // Character checks first: they are the dangerous ones and the most specific messages.
    for c in name.chars() {
        match c {
            '\0' => return Err(SlugError::Nul { name: owned() }),
            '\\' => return Err(SlugError::Backslash { name: owned() }),
            c if c.is_control() => {
                return Err(SlugError::Control {
                    name: owned(),
                    code: u32::from(c),
                })
            }
            _ => {}
        }
    }
    if name.starts_with('/') {
        return Err(SlugError::Absolute { name: owned() });
    }
    for segment in name.split('/') {
        match segment {
            "" => return Err(SlugError::EmptySegment { name: owned() }),
            "." | ".." => {
                return Err(SlugError::DotSegment {
                    name: owned(),
                    segment: segment.to_owned(),
                })
            }
            _ => {}
        }
    }
    let slug = name.replace('/', SEPARATOR_REPLACEMENT);
    if slug.len() > MAX_SLUG_BYTES {
        return Err(SlugError::TooLong {
            name: owned(),
            len: slug.len(),
        });
    }
    Ok(slug)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn replaces_every_separator() {
        assert_eq!(slug("Qwen/Qwen3-0.6B").unwrap(), "Qwen__Qwen3-0.6B");
        assert_eq!(slug("a/b/c").unwrap(), "a__b__c");
        assert_eq!(slug("llama-3.1-8b").unwrap(), "llama-3.1-8b");
        // Dots inside a segment are ordinary characters.
        assert_eq!(slug("org/.hidden/...").unwrap(), "org__.hidden__...");
        assert_eq!(slug("ünïcode/模型").unwrap(), "ünïcode__模型");
    }

    #[test]
    fn model_slug_keeps_both_forms() {
        let m = ModelSlug::new("Qwen/Qwen3-0.6B").unwrap();
        assert_eq!(m.name(), "Qwen/Qwen3-0.6B");
        assert_eq!(m.as_str(), "Qwen__Qwen3-0.6B");
        assert_eq!(m.to_string(), "Qwen__Qwen3-0.6B");
    }

    #[test]
    fn rejects_names_that_escape_or_confuse_a_directory() {
        let n = |s: &str| s.to_owned();
        let cases: [(&str, SlugError); 14] = [
            ("", SlugError::Empty),
            (
                "/etc/passwd",
                SlugError::Absolute {
                    name: n("/etc/passwd"),
                },
            ),
            ("/", SlugError::Absolute { name: n("/") }),
            (
                "..",
                SlugError::DotSegment {
                    name: n(".."),
                    segment: n(".."),
                },
            ),
            (
                ".",
                SlugError::DotSegment {
                    name: n("."),
                    segment: n("."),
                },
            ),
            (
                "a/../b",
                SlugError::DotSegment {
                    name: n("a/../b"),
                    segment: n(".."),
                },
            ),
            (
                "a/.",
                SlugError::DotSegment {
                    name: n("a/."),
                    segment: n("."),
                },
            ),
            ("a//b", SlugError::EmptySegment { name: n("a//b") }),
            ("a/", SlugError::EmptySegment { name: n("a/") }),
            ("a\\b", SlugError::Backslash { name: n("a\\b") }),
            ("..\\x", SlugError::Backslash { name: n("..\\x") }),
            ("a\0b", SlugError::Nul { name: n("a\0b") }),
            (
                "a\nb",
                SlugError::Control {
                    name: n("a\nb"),
                    code: 0x0a,
                },
            ),
            (
                "a\u{7f}",
                SlugError::Control {
                    name: n("a\u{7f}"),
                    code: 0x7f,
                },
            ),
        ];
        for (name, want) in cases {
            assert_eq!(slug(name), Err(want), "{name:?}");
        }
    }

    #[test]
    fn length_limit_applies_to_the_slug() {
        let max = "m".repeat(MAX_SLUG_BYTES);
        assert_eq!(slug(&max).unwrap(), max);
        // 127 + "/" + 127 = 255 bytes as a name, 256 as a slug.
        let name = format!("{}/{}", "a".repeat(127), "b".repeat(127));
        assert_eq!(
            slug(&name),
            Err(SlugError::TooLong {
                name: name.clone(),
                len: 256
            })
        );
    }

    #[test]
    fn messages_name_the_input() {
        assert_eq!(
            slug("a/../b").unwrap_err().to_string(),
            "model name \"a/../b\" has a \"..\" segment, which would leave the tokenizer directory"
        );
        assert_eq!(
            slug("x\u{1}").unwrap_err().to_string(),
            "model name \"x\\u{1}\" contains the control character U+0001"
        );
    }
}
