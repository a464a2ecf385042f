//! Which requests the proxy protects with a key, and which it passes
//! through untouched.

use http::Method;

use crate::config::ConfigError;

/// The protected routes and the passed-through prefixes. A path matches a
/// prefix on a segment boundary: `/pay` matches `/pay` and `/pay/1`, never
/// `/payments`.
#[derive(Debug, Clone)]
pub struct Routes {
    pass: Vec<String>,
    protect: Vec<(Methods, String)>,
}

/// The methods a `--protect` rule names.
#[derive(Debug, Clone)]
enum Methods {
    /// `*`: every method, extension methods (`MKCOL`, `CHARGE`) included.
    Every,
    /// These, in upper case.
    Listed(Vec<Method>),
}

impl Methods {
    /// Whether the rule names `method`, in any case: a server that reads
    /// methods without regard to case (ASP.NET Core, Werkzeug, Django)
    /// takes `post` for `POST`, so `post` is protected where `POST` is.
    fn has(&self, method: &Method) -> bool {
        match self {
            Methods::Every => true,
            Methods::Listed(listed) => listed
                .iter()
                .any(|m| m.as_str().eq_ignore_ascii_case(method.as_str())),
        }
    }
}

fn prefix(option: &'static str, text: &str) -> Result<String, ConfigError> {
    if !text.starts_with('/') || text.contains(['?', '#', ' ']) {
        return Err(ConfigError::Invalid {
            option,
            reason: format!("`{text}` is not a path prefix (`/...`)"),
        });
    }
    Ok(matching_form(text).trim_end_matches('/').to_owned())
}

/// A path in the normal form of RFC 3986 section 6.2.2 (the same resource
/// to any server that follows it): percent-encoded unreserved characters
/// decoded (`%70` is `p`), other escapes in upper case, characters outside
/// ASCII percent-encoded (`/café` is `/caf%C3%A9`), dot segments removed.
/// Repeated slashes are kept. The upstream gets every request's path in
/// this form, and a protected request's fingerprint is of it.
pub fn normal_form(path: &str) -> String {
    remove_dot_segments(&decoded(path))
}

/// The path with its escapes in one form (see [`normal_form`]), its dot
/// segments still in.
fn decoded(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut decoded = String::with_capacity(path.len());
    let hex = |b: u8| char::from(b).to_digit(16);
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' && i + 2 < bytes.len() {
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                let value = (hi * 16 + lo) as u8;
                if value.is_ascii_alphanumeric() || b"-._~".contains(&value) {
                    decoded.push(char::from(value));
                } else {
                    decoded.push_str(&format!("%{value:02X}"));
                }
                i += 3;
                continue;
            }
        }
        if b.is_ascii() {
            decoded.push(char::from(b));
        } else {
            decoded.push_str(&format!("%{b:02X}"));
        }
        i += 1;
    }
    decoded
}

/// The forms a path is compared in to choose a route and to key a
/// request, from the path as the client sent it: an encoded slash or
/// backslash (`%2F`, `%5C`) and a backslash taken as a slash (as some
/// servers take them), path parameters (`;jsessionid=1`, which servlet
/// containers drop before routing) left out of each segment, dot segments
/// removed, repeated slashes merged and a trailing one dropped. Servers
/// differ in the order: parameters up to the next literal slash first (as
/// Tomcat does) or encoded slashes first; repeated slashes merged before
/// dot segments (nginx, Go's `path.Clean`) or after (RFC 3986). So there
/// are four readings, the first the RFC's. [`Routes::route`] reads the
/// normal form, the path the upstream gets: a request is protected when
/// any reading is, so a route is protected however a client spells its
/// path (`//pay`, `/./pay`, `/x/../pay`, `/%70ay`, `/pay/`), and those
/// spellings share a key.
pub fn matching_forms(path: &str) -> [String; 4] {
    let slashes = |p: &str| p.replace("%2F", "/").replace("%5C", "/").replace('\\', "/");
    let bare = |p: &str| {
        p.split('/')
            .map(|segment| segment.split(';').next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("/")
    };
    let text = decoded(path);
    let params_first = slashes(&bare(&text));
    let slashes_first = bare(&slashes(&text));
    [
        tidy(&params_first),
        tidy(&slashes_first),
        tidy(&merged(&params_first)),
        tidy(&merged(&slashes_first)),
    ]
}

/// The first (the RFC's) of the [`matching_forms`].
pub fn matching_form(path: &str) -> String {
    let [first, ..] = matching_forms(path);
    first
}

/// Repeated slashes merged.
fn merged(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        if c == '/' && out.ends_with('/') {
            continue;
        }
        out.push(c);
    }
    out
}

/// Dot segments removed, repeated slashes merged, a trailing one dropped.
fn tidy(path: &str) -> String {
    let dots_gone = remove_dot_segments(path);
    let mut out = String::with_capacity(dots_gone.len());
    for c in dots_gone.chars() {
        if c == '/' && out.ends_with('/') {
            continue;
        }
        out.push(c);
    }
    while out.len() > 1 && out.ends_with('/') {
        out.pop();
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// RFC 3986 section 5.2.4, for an absolute path.
fn remove_dot_segments(path: &str) -> String {
    let Some(rest) = path.strip_prefix('/') else {
        return path.to_owned();
    };
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = rest.split('/').collect();
    let last = segments.len() - 1;
    for (i, segment) in segments.iter().enumerate() {
        match *segment {
            "." => {
                if i == last {
                    out.push("");
                }
            }
            ".." => {
                out.pop();
                if i == last {
                    out.push("");
                }
            }
            other => out.push(other),
        }
    }
    format!("/{}", out.join("/"))
}

fn under(path: &str, prefix: &str) -> bool {
    prefix.is_empty()
        || path == prefix
        || (path.starts_with(prefix) && path.as_bytes().get(prefix.len()) == Some(&b'/'))
}

impl Routes {
    /// Rules as the flags give them: `protect` as `METHODS PREFIX`
    /// (`POST,PATCH /payments`, `* /orders`) or a prefix alone (POST and
    /// PATCH); `pass` as prefixes.
    ///
    /// # Errors
    ///
    /// A rule that does not parse, or names a method that is not one.
    pub fn parse(protect: &[String], pass: &[String]) -> Result<Routes, ConfigError> {
        let pass = pass
            .iter()
            .map(|p| prefix("--pass", p.trim()))
            .collect::<Result<_, _>>()?;
        let mut rules = Vec::new();
        for rule in protect {
            let rule = rule.trim();
            let (methods, path) = match rule.split_once(char::is_whitespace) {
                Some((methods, path)) => (methods, path.trim()),
                None if rule.starts_with('/') => ("POST,PATCH", rule),
                None => {
                    return Err(ConfigError::Invalid {
                        option: "--protect",
                        reason: format!(
                            "`{rule}`: `METHODS /prefix` (e.g. `POST,PATCH /payments`)"
                        ),
                    })
                }
            };
            let methods = if methods == "*" {
                Methods::Every
            } else {
                Methods::Listed(
                    methods
                        .split(',')
                        .map(|m| {
                            Method::from_bytes(m.trim().to_ascii_uppercase().as_bytes()).map_err(
                                |_| ConfigError::Invalid {
                                    option: "--protect",
                                    reason: format!("`{m}` is not an HTTP method"),
                                },
                            )
                        })
                        .collect::<Result<Vec<_>, _>>()?,
                )
            };
            rules.push((methods, prefix("--protect", path)?));
        }
        Ok(Routes {
            pass,
            protect: rules,
        })
    }

    /// Whether a request with this method and path (its
    /// [`matching_form`]) is protected.
    pub fn protects(&self, method: &Method, path: &str) -> bool {
        if self.pass.iter().any(|p| under(path, p)) {
            return false;
        }
        self.protect
            .iter()
            .find(|(_, prefix)| under(path, prefix))
            .is_some_and(|(methods, _)| methods.has(method))
    }

    /// How a request with `method` and the raw `path` is routed: the
    /// path's [`normal_form`], which is what the upstream gets, and, when
    /// it is protected, the path it is keyed by. Both come from the normal
    /// form alone (the upstream never sees the path as sent): protected
    /// when any of its [`matching_forms`] is, keyed by the first that is,
    /// so requests forwarded alike share a key.
    pub fn route(&self, method: &Method, path: &str) -> (String, Option<String>) {
        let normal = normal_form(path);
        // A method no rule protects needs no reading of its path.
        if !self.protect.iter().any(|(methods, _)| methods.has(method)) {
            return (normal, None);
        }
        let key = matching_forms(&normal)
            .into_iter()
            .find(|reading| self.protects(method, reading));
        (normal, key)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_first_matching_rule_wins_and_passes_come_first() {
        let routes = Routes::parse(
            &["GET,POST /payments".into(), "* /orders".into(), "/".into()],
            &["/payments/webhooks".into()],
        )
        .unwrap();
        assert!(routes.protects(&Method::GET, "/payments/1"));
        assert!(
            !routes.protects(&Method::PATCH, "/payments/1"),
            "the first rule that matches the path decides"
        );
        assert!(!routes.protects(&Method::POST, "/payments/webhooks/x"));
        assert!(routes.protects(&Method::DELETE, "/orders"));
        assert!(
            routes.protects(&Method::POST, "/paymentsx"),
            "not under /payments: the `/` rule"
        );
        assert!(!routes.protects(&Method::GET, "/other"));
    }

    /// Every path of up to five segments from an alphabet of tricky ones:
    /// whenever a reading of what the upstream gets (the normal form) is
    /// under a protected prefix, the request is protected; and it is keyed
    /// as the normal form itself would be, so requests forwarded alike
    /// share a key.
    #[test]
    fn whatever_reaches_the_upstream_under_a_protected_prefix_is_protected_under_one_key() {
        let routes = Routes::parse(&["POST /pay".into()], &[]).unwrap();
        let under_pay = |p: &str| p == "/pay" || p.starts_with("/pay/");
        let alphabet = [
            "", ".", "..", "a", "pay", "..;", "a;x", "%2E%2E", "%2F", "..%2F", "%5C", ";x",
        ];
        let n = alphabet.len();
        let mut checked = 0;
        for len in 1..=5u32 {
            for mut code in 0..n.pow(len) {
                let mut segments = Vec::new();
                for _ in 0..len {
                    segments.push(alphabet[code % n]);
                    code /= n;
                }
                let raw = format!("/{}", segments.join("/"));
                let (normal, key) = routes.route(&Method::POST, &raw);
                assert_eq!(
                    normal_form(&normal),
                    normal,
                    "{raw}: the normal form is stable"
                );
                if matching_forms(&normal).iter().any(|r| under_pay(r)) {
                    assert!(
                        key.is_some(),
                        "{raw} reaches the upstream as {normal}, unprotected"
                    );
                }
                if key.is_some() {
                    assert_eq!(
                        routes.route(&Method::POST, &normal).1,
                        key,
                        "{raw}: keyed unlike {normal}, which is forwarded alike"
                    );
                }
                checked += 1;
            }
        }
        assert!(checked > 250_000, "{checked}");
    }

    #[test]
    fn paths_are_compared_in_one_form_however_they_are_spelt() {
        for (raw, normal, matching) in [
            ("/pay", "/pay", "/pay"),
            ("//pay", "//pay", "/pay"),
            ("/pay/", "/pay/", "/pay"),
            ("/./pay", "/pay", "/pay"),
            ("/x/../pay", "/pay", "/pay"),
            ("/../../pay", "/pay", "/pay"),
            ("/%70ay", "/pay", "/pay"),
            ("/%2e%2E/pay", "/pay", "/pay"),
            ("/x%2F..%2Fpay", "/x%2F..%2Fpay", "/pay"),
            ("/x%5c..%5cpay", "/x%5C..%5Cpay", "/pay"),
            ("/a%20b/", "/a%20b/", "/a%20b"),
            ("/pay/.", "/pay/", "/pay"),
            ("/pay/..", "/", "/"),
            ("/", "/", "/"),
            ("/100%", "/100%", "/100%"),
            ("/%zz%4", "/%zz%4", "/%zz%4"),
            ("/caf\u{e9}", "/caf%C3%A9", "/caf%C3%A9"),
            ("/caf%c3%a9", "/caf%C3%A9", "/caf%C3%A9"),
            ("/pay;jsessionid=1", "/pay;jsessionid=1", "/pay"),
            ("/a;x/..;y/pay", "/a;x/..;y/pay", "/pay"),
        ] {
            assert_eq!(normal_form(raw), normal, "{raw}");
            assert_eq!(matching_form(raw), matching, "{raw}");
        }
        // Path parameters up to the next literal slash first (Tomcat), or
        // the slashes first: both readings.
        let forms = matching_forms("/pay;x%2F..%2Fother");
        assert_eq!((forms[0].as_str(), forms[1].as_str()), ("/pay", "/other"));
        // Slashes merged before dot segments (nginx, Go) or after (RFC).
        let forms = matching_forms("/a//../pay");
        assert_eq!((forms[0].as_str(), forms[2].as_str()), ("/a/pay", "/pay"));
        let routes = Routes::parse(&["POST /pay/".into()], &["/pay//hooks".into()]).unwrap();
        assert!(routes.protects(&Method::POST, &matching_form("//pay")));
        assert!(!routes.protects(&Method::POST, &matching_form("/pay/hooks/1")));
    }
}
