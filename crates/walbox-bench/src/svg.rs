//! Plain SVG bar charts for docs/benchmarks.md: no plotting dependency, text
//! that diffs, and it renders on any forge.

use std::fmt::Write;

/// One bar.
pub struct Bar {
    pub label: String,
    pub value: f64,
    /// Text printed after the bar.
    pub note: String,
}

/// A horizontal bar chart: one row per bar, longest bar = the largest value;
/// with `log`, bar lengths follow the logarithm (values spanning decades).
pub fn bars(title: &str, bars: &[Bar], log: bool) -> String {
    const WIDTH: f64 = 760.0;
    const LABEL: f64 = 250.0;
    const ROW: f64 = 28.0;
    const TOP: f64 = 40.0;
    let scale = |v: f64| if log { (1.0 + v.max(0.0)).log10() } else { v };
    let max = bars
        .iter()
        .map(|b| scale(b.value))
        .fold(0.0_f64, f64::max)
        .max(1e-9);
    let height = TOP + ROW * bars.len() as f64 + 10.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="13">"#
    );
    let _ = writeln!(
        out,
        r##"<rect width="100%" height="100%" fill="#ffffff"/>"##
    );
    let _ = writeln!(
        out,
        r#"<text x="10" y="24" font-size="15" font-weight="bold">{}</text>"#,
        escape(title)
    );
    let span = WIDTH - LABEL - 170.0;
    for (i, b) in bars.iter().enumerate() {
        let y = TOP + ROW * i as f64;
        let w = (scale(b.value) / max * span).max(1.0);
        let _ = writeln!(
            out,
            r#"<text x="{:.0}" y="{:.0}" text-anchor="end">{}</text>"#,
            LABEL - 8.0,
            y + 17.0,
            escape(&b.label)
        );
        let fill = if b.label.starts_with("walbox") {
            "#2f6fb0"
        } else {
            "#9aa5b1"
        };
        let _ = writeln!(
            out,
            r#"<rect x="{LABEL}" y="{:.0}" width="{w:.1}" height="{:.0}" fill="{fill}"/>"#,
            y + 4.0,
            ROW - 8.0
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.0}">{}</text>"#,
            LABEL + w + 6.0,
            y + 17.0,
            escape(&b.note)
        );
    }
    out.push_str("</svg>\n");
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
