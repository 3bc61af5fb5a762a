//! The tracing subscriber both daemons install: stderr, a RUST_LOG-style filter, and no
//! timestamps or colours when stderr is the journal (`JOURNAL_STREAM` set by systemd),
//! which stamps every line itself, and no colours when stderr is a file or pipe either.

use std::io::IsTerminal;

/// Installs the global subscriber; an invalid `filter` falls back to `info`.
pub fn init(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var_os("JOURNAL_STREAM").is_some() {
        builder.without_time().with_ansi(false).init();
    } else {
        builder.with_ansi(std::io::stderr().is_terminal()).init();
    }
}
