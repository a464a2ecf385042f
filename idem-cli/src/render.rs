//! Text for a terminal: response previews that cannot wreck it, times and
//! durations.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The most response bytes a preview shows.
pub(crate) const PREVIEW_BYTES: usize = 200;

/// Whether `c` must not reach a terminal as is: control characters (C0,
/// DEL, C1) and the invisible format characters that reorder or hide text
/// (bidi overrides and isolates, zero-width characters, BOM).
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{200B}'..='\u{200F}'
            | '\u{202A}'..='\u{202E}'
            | '\u{2060}'..='\u{2069}'
            | '\u{FEFF}')
}

/// `text` with backslashes and the characters of [`needs_escape`] escaped
/// (`\n`, `\t`, `\r`, `\u{1b}`...): printable on one line, unambiguous.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if needs_escape(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// The first [`PREVIEW_BYTES`] bytes of `bytes` as escaped text (lossy
/// UTF-8: an invalid or cut sequence shows as U+FFFD), so a binary or
/// 1 MiB response prints as one short line.
pub(crate) fn preview(bytes: &[u8]) -> String {
    let shown = &bytes[..bytes.len().min(PREVIEW_BYTES)];
    escape(&String::from_utf8_lossy(shown))
}

/// `s` escaped and cut to `max` characters (with `…`), for a table cell.
pub(crate) fn cell(s: &str, max: usize) -> String {
    let escaped = escape(s);
    if escaped.chars().count() <= max {
        return escaped;
    }
    let mut out: String = escaped.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// Milliseconds from `from` to `to`, negative if `to` is earlier.
pub(crate) fn millis_between(from: SystemTime, to: SystemTime) -> i64 {
    match to.duration_since(from) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
    }
}

/// A duration for a person: `850ms`, `12.3s`, `5m 2s`, `3h 4m`, `2d 3h`.
pub(crate) fn duration(d: Duration) -> String {
    let ms = d.as_millis();
    let s = d.as_secs();
    if ms < 1_000 {
        format!("{ms}ms")
    } else if s < 60 {
        format!("{:.1}s", d.as_secs_f64())
    } else if s < 3_600 {
        format!("{}m {}s", s / 60, s % 60)
    } else if s < 86_400 {
        format!("{}h {}m", s / 3_600, (s % 3_600) / 60)
    } else {
        format!("{}d {}h", s / 86_400, (s % 86_400) / 3_600)
    }
}

/// Signed milliseconds as a duration for a person.
pub(crate) fn signed(ms: i64) -> String {
    duration(Duration::from_millis(ms.unsigned_abs()))
}

/// `t` as RFC 3339 in UTC with milliseconds (`2026-11-23T03:48:01.123Z`).
pub(crate) fn timestamp(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let days = i64::try_from(secs / 86_400).unwrap_or(i64::MAX / 2);
    let rem = secs % 86_400;
    // Days to a civil date (H. Hinnant's algorithm, proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3_600,
        (rem % 3_600) / 60,
        rem % 60,
        since.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn previews_are_short_and_free_of_control_characters() {
        let mut nasty = b"ok\x1b[2J\x1b]0;title\x07\r\n\t\0\x7f\\".to_vec();
        nasty.extend_from_slice("\u{202E}\u{200B}\u{85}é".as_bytes());
        let shown = preview(&nasty);
        assert!(shown.chars().all(|c| !needs_escape(c)), "{shown:?}");
        assert!(shown.starts_with("ok\\u{1b}[2J"), "{shown}");
        assert!(shown.contains("\\r\\n\\t\\u{0}\\u{7f}\\\\"), "{shown}");
        assert!(shown.ends_with("\\u{202e}\\u{200b}\\u{85}é"), "{shown}");
        let big = vec![0xffu8; 1 << 20];
        let shown = preview(&big);
        assert_eq!(shown.chars().count(), PREVIEW_BYTES, "one U+FFFD per byte");
        // A multi-byte character cut at the limit is not a panic.
        let cut = "é".repeat(PREVIEW_BYTES);
        assert!(preview(cut.as_bytes()).ends_with('é'));
        let odd = [b"a".repeat(PREVIEW_BYTES - 1), "é".as_bytes().to_vec()].concat();
        assert!(preview(&odd).ends_with('\u{FFFD}'));
        assert_eq!(preview(b""), "");
    }

    #[test]
    fn cells_are_cut() {
        assert_eq!(cell("abc", 5), "abc");
        assert_eq!(cell("abcdef", 4), "abc…");
        assert_eq!(cell("a\nb", 10), "a\\nb");
    }

    #[test]
    fn times_and_durations_read_well() {
        assert_eq!(timestamp(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_795_405_681_123);
        assert_eq!(timestamp(t), "2026-11-23T03:48:01.123Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(timestamp(leap), "2000-02-29T00:00:00.000Z");
        assert_eq!(duration(Duration::from_millis(850)), "850ms");
        assert_eq!(duration(Duration::from_millis(12_340)), "12.3s");
        assert_eq!(duration(Duration::from_secs(302)), "5m 2s");
        assert_eq!(duration(Duration::from_secs(3 * 3_600 + 240)), "3h 4m");
        assert_eq!(
            duration(Duration::from_secs(2 * 86_400 + 3 * 3_600)),
            "2d 3h"
        );
        assert_eq!(signed(-1_500), "1.5s");
        let a = UNIX_EPOCH + Duration::from_secs(10);
        let b = UNIX_EPOCH + Duration::from_secs(12);
        assert_eq!(millis_between(a, b), 2_000);
        assert_eq!(millis_between(b, a), -2_000);
    }
}
