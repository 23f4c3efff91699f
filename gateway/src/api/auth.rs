//! The optional API key: read from a flag or a key file, compared in constant time, and
//! checked as `Authorization: Bearer <key>` on HTTP and as `authorization` metadata on gRPC.

use std::path::Path;

use tonic::{Request, Status};

/// A bearer token every request must carry.
#[derive(Clone)]
pub struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl ApiKey {
    /// A key given directly; refuses an empty or blank one.
    pub fn new(key: &str) -> Result<ApiKey, String> {
        let key = key.trim();
        if key.is_empty() {
            return Err("the API key is empty".into());
        }
        if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("the API key contains whitespace or control characters".into());
        }
        Ok(ApiKey(key.to_string()))
    }

    /// The key in a file (its first line; surrounding whitespace ignored).
    pub fn from_file(path: &Path) -> Result<ApiKey, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading the API key file {}: {e}", path.display()))?;
        ApiKey::new(text.lines().next().unwrap_or("")).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Whether an `Authorization` header value carries this key.
    pub fn accepts_header(&self, header: Option<&str>) -> bool {
        let Some(token) = header.and_then(|h| h.strip_prefix("Bearer ").or_else(|| h.strip_prefix("bearer "))) else { return false };
        constant_time_eq(token.trim().as_bytes(), self.0.as_bytes())
    }

    /// A tonic interceptor refusing calls without the key with UNAUTHENTICATED.
    pub fn interceptor(self) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
        move |req: Request<()>| {
            let header = req.metadata().get("authorization").and_then(|v| v.to_str().ok());
            if self.accepts_header(header) {
                Ok(req)
            } else {
                Err(Status::unauthenticated("a valid API key is required: metadata authorization: Bearer <key>"))
            }
        }
    }
}

/// Equality whose time depends only on the lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_only_the_bearer_key() {
        let k = ApiKey::new(" s3cret \n").unwrap();
        assert!(k.accepts_header(Some("Bearer s3cret")));
        assert!(!k.accepts_header(Some("Bearer s3cre")));
        assert!(!k.accepts_header(Some("Bearer s3cretX")));
        assert!(!k.accepts_header(Some("s3cret")));
        assert!(!k.accepts_header(Some("Basic s3cret")));
        assert!(!k.accepts_header(None));
        assert!(ApiKey::new("  ").is_err());
        assert!(ApiKey::new("a b").is_err());
    }

    #[test]
    fn key_file_first_line() {
        let path = std::env::temp_dir().join(format!("duet-key-{}", std::process::id()));
        std::fs::write(&path, "abc123\nignored\n").unwrap();
        assert!(ApiKey::from_file(&path).unwrap().accepts_header(Some("Bearer abc123")));
        std::fs::remove_file(&path).unwrap();
        let err = ApiKey::from_file(&path).unwrap_err();
        assert!(err.contains("reading the API key file"), "{err}");
    }
}
