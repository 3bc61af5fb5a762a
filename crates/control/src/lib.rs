//! The control plane both daemons share. A unix socket answers every connection with one
//! JSON document (the daemon's status) and closes; `/metrics` serves OpenMetrics to
//! scrapers that ask for it and the classic text format to the rest, over HTTP. It runs on a current-thread tokio runtime on the caller's thread until `shutdown`
//! resolves, and only ever calls the daemon's closures: it owns no daemon state.
//! Also the one TOML reader both configurations go through, so errors name `file:line`.

pub mod conffile;
pub mod dist;
pub mod exposition;
pub mod logging;
pub mod signals;

use anyhow::{Context, Result};
use serde::de::DeserializeOwned;
use std::future::Future;
use std::io::Read;
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tracing::info;

pub use exposition::OPENMETRICS;

pub struct Endpoints {
    pub status_socket: PathBuf,
    /// `None`: no HTTP listener at all.
    pub metrics: Option<SocketAddr>,
}

/// Serves both endpoints until `shutdown` completes, then removes the status socket.
pub fn serve<S, M, F>(
    thread_name: &str,
    endpoints: &Endpoints,
    status: S,
    metrics: M,
    shutdown: F,
) -> Result<()>
where
    S: Fn() -> Vec<u8> + Send + Sync + 'static,
    M: Fn() -> String + Send + Sync + 'static,
    F: Future<Output = ()>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name(thread_name)
        .build()?;
    let path = endpoints.status_socket.clone();
    let r = rt.block_on(async {
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path)
            .with_context(|| format!("binding status socket {}", path.display()))?;
        let status = Arc::new(status);
        let status_task = tokio::spawn(async move {
            loop {
                let Ok((mut conn, _)) = listener.accept().await else {
                    continue;
                };
                let body = status();
                // A client that stops reading must not hold the control plane.
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    tokio::io::AsyncWriteExt::write_all(&mut conn, &body),
                )
                .await;
            }
        });
        let metrics_task = match endpoints.metrics {
            Some(addr) => {
                let metrics = Arc::new(metrics);
                let app = axum::Router::new().route(
                    "/metrics",
                    axum::routing::get(move |headers: axum::http::HeaderMap| {
                        let metrics = metrics.clone();
                        async move {
                            let accept = headers
                                .get(axum::http::header::ACCEPT)
                                .and_then(|v| v.to_str().ok());
                            if exposition::wants_openmetrics(accept) {
                                ([(axum::http::header::CONTENT_TYPE, OPENMETRICS)], metrics())
                            } else {
                                (
                                    [(axum::http::header::CONTENT_TYPE, exposition::CLASSIC)],
                                    exposition::to_classic(&metrics()),
                                )
                            }
                        }
                    }),
                );
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding metrics on {addr}"))?;
                info!(%addr, "serving /metrics");
                Some(tokio::spawn(
                    async move { axum::serve(listener, app).await },
                ))
            }
            None => None,
        };
        shutdown.await;
        status_task.abort();
        if let Some(t) = metrics_task {
            t.abort();
        }
        anyhow::Ok(())
    });
    let _ = std::fs::remove_file(&path);
    r
}

/// Parses a TOML configuration; errors read `origin:line: message`.
pub fn parse_toml<T: DeserializeOwned>(text: &str, origin: &str) -> Result<T> {
    toml::from_str(text).map_err(|e| {
        let line = e
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        match line {
            Some(line) => anyhow::anyhow!("{origin}:{line}: {}", e.message().trim_end()),
            None => anyhow::anyhow!("{origin}: {}", e.message().trim_end()),
        }
    })
}

/// Parses a TOML configuration and checks its ranges; every error names `origin` and,
/// where it has one, the line.
pub fn parse_checked<T: DeserializeOwned>(
    text: &str,
    origin: &str,
    validate: impl FnOnce(&T) -> std::result::Result<(), Invalid>,
) -> Result<T> {
    let cfg: T = parse_toml(text, origin)?;
    validate(&cfg).map_err(|e| e.located(text, origin))?;
    Ok(cfg)
}

/// The most a configuration file may hold: far more than any real one, and a bound on
/// what a mistaken `--config /dev/zero` or a runaway file can make the daemon read.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Reads `path` and parses it with `parse(text, origin)`. A missing file at the default
/// location means all defaults; a missing file that the user named is an error. Only a
/// regular file of at most `MAX_CONFIG_BYTES` is read.
pub fn load_config<T: Default>(
    path: &Path,
    explicit: bool,
    parse: impl FnOnce(&str, &str) -> Result<T>,
) -> Result<T> {
    match read_bounded(path, "configuration", MAX_CONFIG_BYTES) {
        Ok(text) => parse(&text, &path.display().to_string()),
        Err(e)
            if !explicit
                && e.downcast_ref::<std::io::Error>()
                    .is_some_and(|e| e.kind() == std::io::ErrorKind::NotFound) =>
        {
            Ok(T::default())
        }
        Err(e) => Err(e),
    }
}

/// Reads a file an operator names (`what` says which kind, for the error): refuses
/// anything but a regular file, and anything over `limit` bytes, before reading it, and
/// reads at most `limit` bytes of a file that grows meanwhile. A FIFO is opened without
/// blocking, so a file swapped for one after the check cannot hang the caller.
pub fn read_bounded(path: &Path, what: &str, limit: u64) -> Result<String> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let kind = |t: std::fs::FileType| {
        if t.is_dir() {
            "a directory"
        } else if t.is_char_device() {
            "a character device"
        } else if t.is_block_device() {
            "a block device"
        } else if t.is_fifo() {
            "a FIFO"
        } else if t.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        }
    };
    let check = |meta: &std::fs::Metadata| -> Result<()> {
        if !meta.is_file() {
            anyhow::bail!(
                "{} is {}, not a regular file: a {what} file must be a regular file",
                path.display(),
                kind(meta.file_type())
            );
        }
        if meta.len() > limit {
            anyhow::bail!(
                "{} holds {} bytes, over the {limit} a {what} file may hold",
                path.display(),
                meta.len()
            );
        }
        Ok(())
    };
    // The NotFound error stays an io::Error at the root, so callers can tell it apart.
    let meta = std::fs::metadata(path)
        .map_err(anyhow::Error::from)
        .map_err(|e| e.context(format!("reading {what} {}", path.display())))?;
    check(&meta)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .with_context(|| format!("reading {what} {}", path.display()))?;
    check(&file.metadata()?)?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {what} {}", path.display()))?;
    if bytes.len() as u64 > limit {
        anyhow::bail!(
            "{} grew past the {limit} bytes a {what} file may hold while it was read",
            path.display()
        );
    }
    String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("{}: not UTF-8 text ({e})", path.display()))
}

/// The longest path a unix socket address holds (`sun_path` is 108 bytes, NUL included).
pub const MAX_SOCKET_PATH: usize = 107;

/// Checks that the socket at `path`, set by the configuration's `key`, can ever be bound
/// or connected to.
pub fn socket_path_fits(key: &str, path: &Path) -> std::result::Result<(), Invalid> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(Invalid::new(
            key,
            format!(
                "{key}: the socket path {} is {len} bytes, over the {MAX_SOCKET_PATH} a unix \
                 socket address holds; choose a shorter path",
                path.display()
            ),
        ));
    }
    Ok(())
}

/// The keys (`section.key`, arrays and tables of arrays as a whole) whose values differ
/// between two configurations, split into those `live` says can change in a running
/// daemon and those that need a restart.
pub fn changed_keys<T: serde::Serialize>(
    old: &T,
    new: &T,
    live: impl Fn(&str) -> bool,
) -> (Vec<String>, Vec<String>) {
    fn flatten(
        prefix: &str,
        v: &toml::Value,
        out: &mut std::collections::BTreeMap<String, String>,
    ) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    flatten(&key, v, out);
                }
            }
            other => {
                out.insert(prefix.to_string(), other.to_string());
            }
        }
    }
    let table = |c: &T| {
        let mut out = std::collections::BTreeMap::new();
        if let Ok(v) = toml::Value::try_from(c) {
            flatten("", &v, &mut out);
        }
        out
    };
    let (a, b) = (table(old), table(new));
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .partition(|k| live(k))
}

/// A configuration that a running program takes up again at SIGHUP, in part.
pub trait Reloadable: serde::Serialize + Sized {
    /// The systemd unit whose restart takes up the other keys.
    const UNIT: &'static str;
    /// The keys (`section.key`, as `changed_keys` names them) a running program takes up.
    const LIVE_KEYS: &'static [&'static str];
    /// When they take effect, as the log says after "applied" (" from the next period");
    /// empty when at once.
    const APPLIED_WHEN: &'static str = "";
    /// `self` with the live keys of `new`: what a reload puts into effect.
    fn with_live_keys(&self, new: &Self) -> Self;
}

/// SIGHUP: `load` reads and validates the configuration again. A bad one changes nothing
/// (its error is logged, naming file and line); of a good one, the changed keys that need
/// a restart are named, and `running` with the changed live keys applied is returned
/// (`None` when no live key changed).
pub fn reload<C: Reloadable>(running: &C, load: &dyn Fn() -> Result<C>) -> Option<C> {
    let new = match load() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(
                "SIGHUP: the new configuration is invalid, the running one stays: {e:#}"
            );
            return None;
        }
    };
    let (live, restart) = changed_keys(running, &new, |k| C::LIVE_KEYS.contains(&k));
    if !restart.is_empty() {
        tracing::warn!(
            keys = %restart.join(", "),
            "SIGHUP: changed keys that take effect only after a restart (systemctl restart {})",
            C::UNIT
        );
    }
    if live.is_empty() {
        info!("SIGHUP: configuration reloaded, no live key changed");
        return None;
    }
    info!(
        keys = %live.join(", "),
        "SIGHUP: configuration reloaded, applied{}",
        C::APPLIED_WHEN
    );
    Some(running.with_live_keys(&new))
}

/// The stop signal of a daemon's threads. Every sleep of a long-lived thread is a `nap`
/// on it, so that shutdown takes the same time whatever the configured periods and
/// back-offs are: `set` wakes every napper at once.
#[derive(Debug, Default)]
pub struct Stop {
    set: std::sync::atomic::AtomicBool,
    lock: std::sync::Mutex<()>,
    cv: std::sync::Condvar,
}

impl Stop {
    pub fn set(&self) {
        self.set.store(true, std::sync::atomic::Ordering::SeqCst);
        // Taking the lock orders this store before any napper's check-then-wait.
        drop(self.lock.lock().unwrap_or_else(|e| e.into_inner()));
        self.cv.notify_all();
    }

    pub fn is_set(&self) -> bool {
        self.set.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Sleeps up to `d`; returns whether the stop is set (at once if it already is).
    pub fn nap(&self, d: Duration) -> bool {
        let guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self.cv.wait_timeout_while(guard, d, |_| !self.is_set());
        self.is_set()
    }
}

/// A configuration value outside what a program accepts: the dotted key (`section.key`)
/// and what is wrong with it. `Config::parse` turns it into `origin:line: message`.
#[derive(Debug)]
pub struct Invalid {
    pub key: String,
    pub message: String,
}

impl Invalid {
    pub fn new(key: &str, message: impl std::fmt::Display) -> Invalid {
        Invalid {
            key: key.into(),
            message: message.to_string(),
        }
    }

    /// The error for the user: the file, the line that sets the key (when the text sets
    /// it; a default or a command-line flag has none) and the message.
    pub fn located(&self, text: &str, origin: &str) -> anyhow::Error {
        match key_line(text, &self.key) {
            Some(line) => anyhow::anyhow!("{origin}:{line}: {}", self.message),
            None => anyhow::anyhow!("{origin}: {}", self.message),
        }
    }
}

/// Checks that `key`'s `value` lies in `lo..=hi`; NaN never does.
pub fn in_range<T: PartialOrd + std::fmt::Display>(
    key: &str,
    value: T,
    lo: T,
    hi: T,
) -> std::result::Result<(), Invalid> {
    if value >= lo && value <= hi {
        Ok(())
    } else {
        Err(Invalid::new(
            key,
            format!("{key} = {value} is outside {lo}..={hi}"),
        ))
    }
}

/// The 1-based line of TOML `text` that sets the dotted `key` (`period_ms`,
/// `monitor.period_us`), or the header of the table `key` names (`[[vm]]`).
pub fn key_line(text: &str, key: &str) -> Option<usize> {
    let (table, name) = key.rsplit_once('.').unwrap_or(("", key));
    let mut current = String::new();
    for (i, line) in text.lines().enumerate() {
        let l = line.trim();
        if let Some(h) = l.strip_prefix('[') {
            current = h.trim_matches(|c| c == '[' || c == ']').trim().to_string();
            if current == key {
                return Some(i + 1);
            }
            continue;
        }
        let Some((k, _)) = l.split_once('=') else {
            continue;
        };
        let k = k.trim().trim_matches('"');
        if current == table && k == name {
            return Some(i + 1);
        }
    }
    None
}

/// Serves the daemon's signals until one asks it to stop (returns its name): SIGHUP
/// calls `reload`, SIGUSR1 and SIGUSR2 are said in the log and ignored.
pub async fn until_stopped(
    signals: &mut signals::Signals,
    mut reload: impl FnMut(),
) -> &'static str {
    loop {
        match signals.next().await {
            signals::Event::Stop(name) => return name,
            signals::Event::Reload => reload(),
            signals::Event::Ignored(name) => info!(
                "{name} ignored: SIGHUP reloads the configuration, SIGTERM, SIGINT and SIGQUIT stop"
            ),
        }
    }
}

/// Reads one status document from a running daemon's socket.
pub fn query<T: DeserializeOwned>(socket: &Path, daemon: &str) -> Result<T> {
    let mut stream = UnixStream::connect(socket).with_context(|| {
        format!(
            "connecting to {} (is `{daemon} run` running with this state directory?)",
            socket.display()
        )
    })?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    serde_json::from_str(&text).with_context(|| format!("bad status from {}", socket.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn a_stop_wakes_a_long_nap_at_once() {
        let stop = Arc::new(Stop::default());
        assert!(!stop.nap(Duration::from_millis(1)));
        let napper = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let t0 = std::time::Instant::now();
                assert!(stop.nap(Duration::from_secs(600)));
                t0.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        stop.set();
        let slept = napper.join().unwrap();
        assert!(
            slept < Duration::from_secs(5),
            "napped {slept:?} after the stop"
        );
        assert!(
            stop.nap(Duration::from_secs(600)),
            "a set stop never sleeps"
        );
    }

    #[test]
    fn a_key_is_found_on_its_line_in_its_table() {
        let text = "period_ms = 5\n# c\n[monitor]\nperiod_us=1\n\n[[vm]]\nname = \"a\"\n";
        assert_eq!(key_line(text, "period_ms"), Some(1));
        assert_eq!(key_line(text, "monitor.period_us"), Some(4));
        assert_eq!(key_line(text, "period_us"), None, "top-level only");
        assert_eq!(key_line(text, "vm"), Some(6));
        assert_eq!(key_line(text, "vm.name"), Some(7));
        assert_eq!(key_line(text, "monitor.idle_period_us"), None);
        let e = in_range("monitor.period_us", 1u64, 50, 100_000).unwrap_err();
        assert_eq!(
            e.located(text, "f.toml").to_string(),
            "f.toml:4: monitor.period_us = 1 is outside 50..=100000"
        );
        assert!(in_range("x", f64::NAN, 0.0, 1.0).is_err());
        assert!(in_range("x", f64::INFINITY, 0.0, 1.0).is_err());
        assert!(in_range("x", 1.0, 0.0, 1.0).is_ok());
    }

    #[test]
    fn serves_status_and_metrics_until_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("status.sock");
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = probe.local_addr().unwrap();
        drop(probe);
        let stop = Arc::new(AtomicBool::new(false));
        let ep = Endpoints {
            status_socket: sock.clone(),
            metrics: Some(addr),
        };
        let server = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                serve(
                    "test-ctl",
                    &ep,
                    || br#"{"answer":42}"#.to_vec(),
                    || "# TYPE c counter\nc_total 1\nc_created 1.5\n# EOF\n".to_string(),
                    async move {
                        while !stop.load(Ordering::Relaxed) {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    },
                )
            })
        };
        let mut got = None;
        for _ in 0..200 {
            if let Ok(v) = query::<serde_json::Value>(&sock, "test") {
                got = Some(v);
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(got.unwrap()["answer"], 42);
        let get = |accept: &str| {
            let mut http = std::net::TcpStream::connect(addr).unwrap();
            http.write_all(format!("GET /metrics HTTP/1.0\r\n{accept}\r\n").as_bytes())
                .unwrap();
            let mut resp = String::new();
            http.read_to_string(&mut resp).unwrap();
            resp
        };
        // Prometheus asks for OpenMetrics and gets it as encoded...
        let resp = get("Accept: application/openmetrics-text;version=1.0.0\r\n");
        assert!(
            resp.contains(OPENMETRICS) && resp.ends_with("c_created 1.5\n# EOF\n"),
            "{resp}"
        );
        // ...anyone else gets the classic text format.
        let resp = get("");
        assert!(
            resp.contains(exposition::CLASSIC)
                && resp.ends_with("# TYPE c_total counter\nc_total 1\n"),
            "{resp}"
        );
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap().unwrap();
        assert!(!sock.exists(), "the status socket is removed at shutdown");
        let e = query::<serde_json::Value>(&sock, "test").unwrap_err();
        assert!(format!("{e:#}").contains("is `test run` running"), "{e:#}");
    }

    #[test]
    fn a_socket_path_fits_sun_path_up_to_107_bytes() {
        let path = |n: usize| PathBuf::from(format!("/{}", "s".repeat(n - 1)));
        assert!(socket_path_fits("state_dir", &path(107)).is_ok());
        let e = socket_path_fits("state_dir", &path(108)).unwrap_err();
        assert_eq!(e.key, "state_dir");
        assert!(
            e.message.starts_with("state_dir: the socket path /s"),
            "{}",
            e.message
        );
        // What the kernel says of the same two lengths.
        let dir = tempfile::tempdir().unwrap();
        let at = |n: usize| {
            let prefix = dir.path().as_os_str().len() + 1;
            dir.path().join("s".repeat(n - prefix))
        };
        assert!(std::os::unix::net::UnixListener::bind(at(107)).is_ok());
        assert!(std::os::unix::net::UnixListener::bind(at(108)).is_err());
    }

    #[test]
    fn a_reload_tells_live_keys_from_restart_keys() {
        #[derive(serde::Serialize, Clone)]
        struct S {
            a: u32,
            list: Vec<String>,
            t: T,
        }
        #[derive(serde::Serialize, Clone)]
        struct T {
            b: bool,
            c: String,
        }
        let old = S {
            a: 1,
            list: vec!["x".into()],
            t: T {
                b: true,
                c: "p".into(),
            },
        };
        let mut new = old.clone();
        assert_eq!(changed_keys(&old, &new, |_| true), (vec![], vec![]));
        new.list.push("y".into());
        new.t.c = "q".into();
        new.a = 2;
        let (live, restart) = changed_keys(&old, &new, |k| k == "list");
        assert_eq!(live, ["list"]);
        assert_eq!(restart, ["a", "t.c"]);
    }

    #[test]
    fn a_reload_applies_only_changed_live_keys_and_a_bad_file_changes_nothing() {
        #[derive(serde::Serialize, Clone, Debug, PartialEq)]
        struct R {
            live: u32,
            fixed: u32,
        }
        impl Reloadable for R {
            const UNIT: &'static str = "test";
            const LIVE_KEYS: &'static [&'static str] = &["live"];
            fn with_live_keys(&self, new: &Self) -> Self {
                R {
                    live: new.live,
                    ..self.clone()
                }
            }
        }
        let running = R { live: 1, fixed: 1 };
        assert_eq!(reload(&running, &|| anyhow::bail!("f.toml:1: bad")), None);
        assert_eq!(
            reload(&running, &|| Ok(R { live: 1, fixed: 2 })),
            None,
            "only a restart key changed: nothing to apply"
        );
        assert_eq!(
            reload(&running, &|| Ok(R { live: 5, fixed: 2 })),
            Some(R { live: 5, fixed: 1 }),
            "the live key applied, the restart key left as it runs"
        );
    }

    #[test]
    fn toml_errors_name_the_line() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct C {
            a: u32,
        }
        let e = parse_toml::<C>("a = 1\n\nb = 2\n", "f.toml").unwrap_err();
        assert!(
            e.to_string().starts_with("f.toml:3: unknown field `b`"),
            "{e}"
        );
        assert_eq!(parse_toml::<C>("a = 7\n", "f").unwrap().a, 7);
    }
}
