//! What the fault tests print: one `reliability scenario=... backend=...`
//! line per scenario, with its figures (RELIABILITY.md tabulates them,
//! `scripts/reliability_report.py` reads them), and the chain of an error's
//! messages.

use std::time::Instant;

/// Prints `reliability scenario=<scenario> backend=<backend> k=v ...
/// duration_ms=<since started>`.
pub fn report(scenario: &str, backend: &str, fields: &[(&str, String)], started: Instant) {
    let mut line = format!("reliability scenario={scenario} backend={backend}");
    for (k, v) in fields {
        line.push_str(&format!(" {k}={v}"));
    }
    line.push_str(&format!(" duration_ms={}", started.elapsed().as_millis()));
    println!("{line}");
}

/// An error's message and those of its sources, joined by ` <- `.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(" <- ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
