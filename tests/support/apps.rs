//! Real applications from Debian's packages for the benchmarks, started cold as a user
//! starts them: PostgreSQL with `pgbench`, nginx serving a tree of small files to `wrk`,
//! and a backup (`tar` of that tree into a checksum). Each run puts the server and its
//! client in one memory cgroup (so that the server's reads reach the disk, as on a small
//! VM, and so that an oracle can find every task of the application), optionally pinned to
//! a CPU, and reports the application's own figures from its first request.
//!
//! Owns starting, measuring and stopping the applications and their data under one
//! directory. Never touches a system service's data: everything lives under `Apps::dir`.

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::{ncpus, stats};

/// Where the applications' data lives when `VMIGRATER_APPS_DIR` does not say: outside
/// target/, so that `cargo clean` does not drop a 1.5 GB database built in minutes.
pub const DEFAULT_DIR: &str = "/var/tmp/vmigrater-apps";
/// pgbench's scale: ~1.5 GB of tables and indexes, ten times the server's memory bound.
pub const PG_SCALE: u32 = 100;
/// The tree of the web server and the backup: 100 directories of 1,000 files of 16 KiB.
const TREE_DIRS: usize = 100;
const TREE_FILES: usize = 1000;
const TREE_FILE_BYTES: usize = 16 << 10;
const NGINX_PORT: u16 = 18080;

/// One application of the benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum App {
    /// pgbench's built-in select-only script (one indexed read per transaction).
    PgSelect { clients: usize },
    /// pgbench's TPC-B-like script (updates, an insert, a synchronous commit).
    PgTpcb { clients: usize },
    /// nginx (`worker_processes auto`, sendfile) serving random files of the tree to wrk.
    Nginx { connections: usize },
    /// `tar` of the whole tree into `md5sum`: bytes archived per second.
    Backup,
}

impl App {
    pub const ALL: [App; 7] = [
        App::PgSelect { clients: 1 },
        App::PgSelect { clients: 8 },
        App::PgTpcb { clients: 1 },
        App::PgTpcb { clients: 8 },
        App::Nginx { connections: 4 },
        App::Backup,
        App::Nginx { connections: 1 },
    ];

    pub fn name(&self) -> String {
        match self {
            App::PgSelect { clients } => format!("pg_select_c{clients}"),
            App::PgTpcb { clients } => format!("pg_tpcb_c{clients}"),
            App::Nginx { connections } => format!("nginx_c{connections}"),
            App::Backup => "backup".into(),
        }
    }

    pub fn parse(name: &str) -> Result<App> {
        App::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .with_context(|| {
                let names: Vec<String> = App::ALL.iter().map(App::name).collect();
                format!("unknown application {name:?}; known: {}", names.join(","))
            })
    }

    /// The figure of merit: larger is better.
    pub fn metric(&self) -> &'static str {
        match self {
            App::PgSelect { .. } | App::PgTpcb { .. } => "tps",
            App::Nginx { .. } => "req_s",
            App::Backup => "mb_s",
        }
    }

    /// Command names of the application's server side: the tasks a policy should find.
    pub fn server_comms(&self) -> &'static [&'static str] {
        match self {
            App::PgSelect { .. } | App::PgTpcb { .. } => &["postgres"],
            App::Nginx { .. } => &["nginx"],
            App::Backup => &["tar"],
        }
    }

    /// Memory bound of the application's cgroup: a small VM's page cache.
    fn memory_bytes(&self) -> u64 {
        match self {
            App::PgSelect { .. } | App::PgTpcb { .. } => 160 << 20,
            App::Nginx { .. } | App::Backup => 64 << 20,
        }
    }
}

/// How an application's processes are started: in which cgroup, pinned where.
#[derive(Clone, Debug, Default)]
pub struct Placement {
    /// The server's CPU (its processes inherit it).
    pub server_cpu: Option<usize>,
    /// The client's CPU (pgbench, wrk, md5sum).
    pub client_cpu: Option<usize>,
}

/// What one run of an application measured.
#[derive(Debug)]
pub struct AppRun {
    /// The figure of merit over the run (`App::metric`).
    pub value: f64,
    /// Seconds from the first request to the end of the measurement.
    pub elapsed_s: f64,
    /// The figure in each whole second from the first request (when the application says).
    pub per_s: Vec<f64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// Wall-clock time of the first request (Unix seconds): the daemon's log is matched to it.
    pub first_request_unix_s: f64,
    /// Seconds the server took to answer after its start, under the same schedule.
    pub server_start_s: f64,
    pub extra: Value,
}

/// The applications' directory, data prepared once, and the cgroup of each run.
pub struct Apps {
    pub dir: PathBuf,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn pg_bin() -> Result<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .context("PostgreSQL is not installed (apt-get install postgresql)")?
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join("postgres").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .context("no /usr/lib/postgresql/*/bin/postgres")
}

fn which(prog: &str) -> Result<PathBuf> {
    ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(prog))
        .find(|p| p.exists())
        .with_context(|| format!("{prog} is not installed (scripts/setup.sh installs it)"))
}

/// A cgroup v1 memory group (this machine kind's hierarchy), removed on drop after its
/// tasks are killed.
pub struct MemCgroup {
    path: PathBuf,
}

impl MemCgroup {
    pub fn create(name: &str, limit_bytes: u64) -> Result<MemCgroup> {
        let path = Path::new("/sys/fs/cgroup/memory").join(name);
        if path.exists() {
            // A leftover of an interrupted run: empty it first.
            let old = MemCgroup { path: path.clone() };
            drop(old);
        }
        std::fs::create_dir(&path).with_context(|| {
            format!(
                "creating {} (cgroup v1 memory controller, root)",
                path.display()
            )
        })?;
        let cg = MemCgroup { path };
        std::fs::write(
            cg.path.join("memory.limit_in_bytes"),
            limit_bytes.to_string(),
        )
        .context("memory.limit_in_bytes")?;
        Ok(cg)
    }

    /// The file a process writes its pid into to join.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// Every thread in the group now.
    pub fn tasks(&self) -> Vec<u32> {
        std::fs::read_to_string(self.path.join("tasks"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Peak memory charged to the group (page cache included).
    pub fn max_usage_bytes(&self) -> u64 {
        std::fs::read_to_string(self.path.join("memory.max_usage_in_bytes"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            let tasks = self.tasks();
            if tasks.is_empty() {
                break;
            }
            for t in tasks {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(t as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Err(e) = std::fs::remove_dir(&self.path) {
            eprintln!("WARNING: removing {}: {e}", self.path.display());
        }
    }
}

/// A command that joins `cg` before it execs (so that every process it starts is in the
/// group), pinned to `cpu` when asked or else free on every CPU (as a service manager
/// starts it, whatever mask this process has), as `user` when given (setpriv keeps one
/// process). It is killed when the benchmark dies (a server left behind would serve the
/// next benchmark's requests from its cache, or hold its port).
fn command(cg: &MemCgroup, cpu: Option<usize>, user: Option<&str>, prog: &Path) -> Command {
    let mut c = Command::new("/bin/sh");
    c.arg("-c")
        .arg("echo $$ > \"$0\" && exec \"$@\"")
        .arg(cg.procs_file());
    if let Some(u) = user {
        // A change of user clears the parent-death signal: setpriv sets it again.
        c.args(["setpriv", "--reuid", u, "--regid", u, "--init-groups"]);
        c.args(["--pdeathsig", "SIGKILL"]);
    }
    c.arg(prog);
    let all = ncpus();
    let mut set = nix::sched::CpuSet::new();
    for c in cpu.map_or(0..all, |c| c..c + 1) {
        let _ = set.set(c);
    }
    // SAFETY: sched_setaffinity and prctl are plain syscalls on the child itself, safe
    // after fork; the set is built before the fork.
    unsafe {
        c.pre_exec(move || {
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)?;
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
            Ok(())
        });
    }
    c
}

/// Drops the page cache (and dentries and inodes), after writing back what is dirty: every
/// run starts cold.
pub fn drop_caches() -> Result<()> {
    nix::unistd::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3").context("drop_caches (root)")
}

fn postgres_ids() -> Result<(u32, u32)> {
    let u = nix::unistd::User::from_name("postgres")?
        .context("no postgres user (apt-get install postgresql)")?;
    Ok((u.uid.as_raw(), u.gid.as_raw()))
}

fn run_checked(c: &mut Command, what: &str) -> Result<String> {
    let out = c.output().with_context(|| format!("starting {what}"))?;
    ensure!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn as_postgres(prog: &Path) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid",
        "postgres",
        "--regid",
        "postgres",
        "--init-groups",
    ])
    .arg(prog);
    c
}

impl Apps {
    pub fn new() -> Apps {
        Apps {
            dir: std::env::var_os("VMIGRATER_APPS_DIR")
                .map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from),
        }
    }

    fn pg_data(&self) -> PathBuf {
        self.dir.join("pg")
    }

    fn pg_sock(&self) -> PathBuf {
        self.dir.join("pgsock")
    }

    fn tree(&self) -> PathBuf {
        self.dir.join("files")
    }

    /// Builds what `app` needs once (the database, the tree); later calls find it ready.
    pub fn prepare(&self, app: App) -> Result<()> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        match app {
            App::PgSelect { .. } | App::PgTpcb { .. } => self.prepare_pg(),
            App::Nginx { .. } | App::Backup => self.prepare_tree(),
        }
    }

    /// Reads every file `app` uses once, then drops the guest's page cache. On a virtual
    /// disk the host keeps its own cache, which the guest cannot drop: read cold, the same
    /// data set took 35 s, read again 1.5 s (on the 2-vCPU guest the benchmarks run on),
    /// and a benchmark that started with the host's cache cold drifted upward run after run (in-phase
    /// select-only, vanilla 653 → 1,076 tps over eight repetitions). Settled once before
    /// the repetitions, every run meets the same storage; each still starts with the
    /// guest's cache empty. Returns the bytes read.
    pub fn settle_storage(&self, app: App) -> Result<u64> {
        let root = match app {
            App::PgSelect { .. } | App::PgTpcb { .. } => self.pg_data(),
            App::Nginx { .. } | App::Backup => self.tree(),
        };
        let mut bytes = 0;
        let mut stack = vec![root];
        while let Some(dir) = stack.pop() {
            for entry in
                std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
            {
                let entry = entry?;
                let kind = entry.file_type()?;
                if kind.is_dir() {
                    stack.push(entry.path());
                } else if kind.is_file() {
                    let mut f = std::fs::File::open(entry.path())
                        .with_context(|| format!("opening {}", entry.path().display()))?;
                    bytes += std::io::copy(&mut f, &mut std::io::sink())?;
                }
            }
        }
        drop_caches()?;
        Ok(bytes)
    }

    fn prepare_pg(&self) -> Result<()> {
        let marker = self.dir.join(format!("pg.scale-{PG_SCALE}"));
        if marker.exists() {
            return Ok(());
        }
        let bin = pg_bin()?;
        let (uid, gid) = postgres_ids()?;
        std::os::unix::fs::chown(&self.dir, Some(uid), Some(gid))
            .with_context(|| format!("chown postgres {}", self.dir.display()))?;
        let data = self.pg_data();
        if data.exists() {
            std::fs::remove_dir_all(&data)?;
        }
        eprintln!(
            "preparing PostgreSQL in {} (pgbench scale {PG_SCALE}, ~1.5 GB, a few minutes)",
            data.display()
        );
        run_checked(
            as_postgres(&bin.join("initdb"))
                .arg("-D")
                .arg(&data)
                .args(["-A", "trust", "-U", "postgres"]),
            "initdb",
        )?;
        let server = self.start_pg_server(&bin, None, None)?;
        let init = run_checked(
            as_postgres(&bin.join("pgbench"))
                .arg("-h")
                .arg(self.pg_sock())
                .args(["-i", "-q", "-s", &PG_SCALE.to_string(), "postgres"]),
            "pgbench -i",
        );
        stop_pg_server(server)?;
        init?;
        std::fs::write(&marker, "")?;
        Ok(())
    }

    /// Starts the postmaster (in `cg`, pinned to `cpu`, when given) and returns once it
    /// accepts connections; the pid is the postmaster's (setpriv execs it).
    fn start_pg_server(
        &self,
        bin: &Path,
        cg: Option<&MemCgroup>,
        cpu: Option<usize>,
    ) -> Result<Child> {
        let (uid, gid) = postgres_ids()?;
        std::fs::create_dir_all(self.pg_sock())?;
        std::os::unix::fs::chown(self.pg_sock(), Some(uid), Some(gid))?;
        let postgres = bin.join("postgres");
        let mut c = match cg {
            Some(cg) => command(cg, cpu, Some("postgres"), &postgres),
            None => as_postgres(&postgres),
        };
        c.arg("-D")
            .arg(self.pg_data())
            .arg("-k")
            .arg(self.pg_sock());
        // Small shared buffers: reads go through the (bounded) page cache, as on a small VM.
        for setting in [
            "listen_addresses=",
            "shared_buffers=16MB",
            "max_connections=32",
        ] {
            c.args(["-c", setting]);
        }
        let log = std::fs::File::create(self.dir.join("postgres.log"))?;
        let mut child = c
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting postgres")?;
        let t0 = Instant::now();
        loop {
            let ok = Command::new(bin.join("pg_isready"))
                .arg("-q")
                .arg("-h")
                .arg(self.pg_sock())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Ok(child);
            }
            if let Some(st) = child.try_wait()? {
                bail!(
                    "postgres exited at start with {st}; see {}",
                    self.dir.join("postgres.log").display()
                );
            }
            if t0.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                bail!("postgres did not accept connections within 120 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn prepare_tree(&self) -> Result<()> {
        let tree = self.tree();
        let marker = self.dir.join(format!(
            "files.{TREE_DIRS}x{TREE_FILES}x{}k",
            TREE_FILE_BYTES >> 10
        ));
        if marker.exists() {
            return Ok(());
        }
        eprintln!(
            "preparing {TREE_DIRS}x{TREE_FILES} files of {} KiB in {}",
            TREE_FILE_BYTES >> 10,
            tree.display()
        );
        let mut buf = vec![0u8; TREE_FILE_BYTES];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for d in 0..TREE_DIRS {
            let dir = tree.join(format!("d{d:02}"));
            std::fs::create_dir_all(&dir)?;
            for f in 0..TREE_FILES {
                // Incompressible content, different in every file.
                for chunk in buf.chunks_mut(8) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
                }
                std::fs::write(dir.join(format!("f{f:04}")), &buf)?;
            }
        }
        nix::unistd::sync();
        std::fs::write(&marker, "")?;
        Ok(())
    }

    /// Runs `app` once, cold, for `secs` from its first request, its processes in a fresh
    /// memory cgroup placed as `place` says. `on_start` is called with the cgroup once the
    /// server is up and before the first request (an oracle starts there).
    pub fn run(
        &self,
        app: App,
        secs: f64,
        place: &Placement,
        on_start: &mut dyn FnMut(&MemCgroup),
    ) -> Result<AppRun> {
        let cg = MemCgroup::create(
            &format!("vmigrater-apps-{}", std::process::id()),
            app.memory_bytes(),
        )?;
        let mut run = match app {
            App::PgSelect { clients } => {
                self.run_pgbench(&cg, true, clients, secs, place, on_start)
            }
            App::PgTpcb { clients } => self.run_pgbench(&cg, false, clients, secs, place, on_start),
            App::Nginx { connections } => self.run_nginx(&cg, connections, secs, place, on_start),
            App::Backup => self.run_backup(&cg, secs, place, on_start),
        }?;
        run.extra["cgroup_max_usage_mb"] = json!(cg.max_usage_bytes() as f64 / 1e6);
        Ok(run)
    }

    fn run_pgbench(
        &self,
        cg: &MemCgroup,
        select_only: bool,
        clients: usize,
        secs: f64,
        place: &Placement,
        on_start: &mut dyn FnMut(&MemCgroup),
    ) -> Result<AppRun> {
        let bin = pg_bin()?;
        let t_start = Instant::now();
        let server = self.start_pg_server(&bin, Some(cg), place.server_cpu)?;
        let server_start_s = t_start.elapsed().as_secs_f64();
        let logs = self.dir.join("pgbench-log");
        if logs.exists() {
            std::fs::remove_dir_all(&logs)?;
        }
        std::fs::create_dir_all(&logs)?;
        let (uid, gid) = postgres_ids()?;
        std::os::unix::fs::chown(&logs, Some(uid), Some(gid))?;
        on_start(cg);
        let secs_i = secs.round().max(1.0) as u64;
        let mut c = command(cg, place.client_cpu, Some("postgres"), &bin.join("pgbench"));
        c.arg("-h").arg(self.pg_sock()).args([
            "-n",
            "-c",
            &clients.to_string(),
            "-j",
            &clients.min(2).to_string(),
            "-T",
            &secs_i.to_string(),
            "-l",
        ]);
        c.arg(format!("--log-prefix={}", logs.join("tx").display()));
        if select_only {
            c.arg("-S");
        }
        c.arg("postgres");
        let first_request_unix_s = unix_now();
        let out = c.output().context("running pgbench");
        let stopped = stop_pg_server(server);
        let out = out?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        ensure!(
            out.status.success(),
            "pgbench failed ({}): {stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        stopped?;
        let field = |key: &str| -> Option<f64> {
            stdout
                .lines()
                .find_map(|l| l.trim().strip_prefix(key))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.split('/').next())
                .and_then(|v| v.parse().ok())
        };
        let tx = field("number of transactions actually processed:")
            .context("pgbench printed no transaction count")?;
        let failed = field("number of failed transactions:").unwrap_or(0.0);
        let (lat_ms, per_s) = pgbench_log(&logs, first_request_unix_s, secs_i)?;
        Ok(AppRun {
            value: tx / secs_i as f64,
            elapsed_s: secs_i as f64,
            per_s,
            p50_ms: stats::median(&lat_ms),
            p99_ms: quantile(&lat_ms, 0.99),
            first_request_unix_s,
            server_start_s,
            extra: json!({
                "transactions": tx,
                "failed": failed,
                "latency_average_ms": field("latency average ="),
                "clients": clients,
                "script": if select_only { "select-only" } else { "tpcb-like" },
            }),
        })
    }

    fn run_nginx(
        &self,
        cg: &MemCgroup,
        connections: usize,
        secs: f64,
        place: &Placement,
        on_start: &mut dyn FnMut(&MemCgroup),
    ) -> Result<AppRun> {
        let prefix = self.dir.join("nginx");
        std::fs::create_dir_all(prefix.join("logs"))?;
        let conf = prefix.join("nginx.conf");
        std::fs::write(
            &conf,
            format!(
                "daemon off;\nmaster_process on;\nworker_processes auto;\nuser www-data;\n\
                 error_log stderr warn;\npid {pid};\nevents {{ worker_connections 256; }}\n\
                 http {{\n  access_log off;\n  sendfile on;\n  keepalive_requests 1000000;\n\
                 \x20 client_body_temp_path {p}/tmp;\n  proxy_temp_path {p}/tmp;\n\
                 \x20 fastcgi_temp_path {p}/tmp;\n  uwsgi_temp_path {p}/tmp;\n  scgi_temp_path {p}/tmp;\n\
                 \x20 server {{\n    listen 127.0.0.1:{NGINX_PORT};\n    root {root};\n  }}\n}}\n",
                pid = prefix.join("nginx.pid").display(),
                p = prefix.display(),
                root = self.tree().display(),
            ),
        )?;
        let script = prefix.join("random.lua");
        std::fs::write(
            &script,
            format!(
                "math.randomseed(os.time() + tonumber(tostring({{}}):sub(8), 16))\n\
                 request = function()\n  return wrk.format(nil, string.format(\"/d%02d/f%04d\", \
                 math.random(0, {}), math.random(0, {})))\nend\n",
                TREE_DIRS - 1,
                TREE_FILES - 1
            ),
        )?;
        let t_start = Instant::now();
        let mut server = command(cg, place.server_cpu, None, &which("nginx")?)
            .arg("-p")
            .arg(&prefix)
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(prefix.join("logs/stderr.log"))?)
            .spawn()
            .context("starting nginx")?;
        let up = wait_for_port(NGINX_PORT, &mut server);
        let server_start_s = t_start.elapsed().as_secs_f64();
        if let Err(e) = up {
            let _ = server.kill();
            let _ = server.wait();
            return Err(e);
        }
        on_start(cg);
        let secs_i = secs.round().max(1.0) as u64;
        let threads = connections.min(2);
        let mut c = command(cg, place.client_cpu, None, &which("wrk")?);
        c.args([
            "-t",
            &threads.to_string(),
            "-c",
            &connections.to_string(),
            "-d",
            &format!("{secs_i}s"),
            "--latency",
            "-s",
        ])
        .arg(&script)
        .arg(format!("http://127.0.0.1:{NGINX_PORT}/"));
        let first_request_unix_s = unix_now();
        let out = c.output().context("running wrk");
        // SIGQUIT: nginx's graceful stop.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(server.id() as i32),
            nix::sys::signal::Signal::SIGQUIT,
        );
        let _ = server.wait();
        let out = out?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        ensure!(
            out.status.success(),
            "wrk failed ({}): {stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let rps = stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix("Requests/sec:"))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .context("wrk printed no Requests/sec")?;
        let pct = |p: &str| -> Option<f64> {
            stdout
                .lines()
                .map(str::trim)
                .find_map(|l| l.strip_prefix(p))
                .and_then(|v| wrk_ms(v.trim()))
        };
        let non2xx = stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix("Non-2xx or 3xx responses:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        ensure!(non2xx == 0, "nginx answered {non2xx} requests with errors");
        Ok(AppRun {
            value: rps,
            elapsed_s: secs_i as f64,
            per_s: Vec::new(),
            p50_ms: pct("50%"),
            p99_ms: pct("99%"),
            first_request_unix_s,
            server_start_s,
            extra: json!({"connections": connections, "wrk_threads": threads}),
        })
    }

    fn run_backup(
        &self,
        cg: &MemCgroup,
        secs: f64,
        place: &Placement,
        on_start: &mut dyn FnMut(&MemCgroup),
    ) -> Result<AppRun> {
        // md5sum starts first, pinned as the client; tar (the server side) writes into it.
        let mut sum = command(cg, place.client_cpu, None, &which("md5sum")?)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting md5sum")?;
        let into = sum.stdin.take().context("md5sum's stdin")?;
        let t0 = Instant::now();
        let first_request_unix_s = unix_now();
        let mut tar = command(cg, place.server_cpu, None, &which("tar")?)
            .args(["-cf", "-", "-C"])
            .arg(self.tree())
            .arg(".")
            .stdout(into)
            .stderr(Stdio::piped())
            .spawn()
            .context("starting tar")?;
        on_start(cg);
        let deadline = t0 + Duration::from_secs_f64(secs);
        let io = format!("/proc/{}/io", tar.id());
        let rchar = || -> Option<u64> {
            std::fs::read_to_string(&io)
                .ok()?
                .lines()
                .find_map(|l| l.strip_prefix("rchar:"))?
                .trim()
                .parse()
                .ok()
        };
        let (mut last, mut per_s) = (0u64, Vec::new());
        let mut next = t0 + Duration::from_secs(1);
        let finished = loop {
            if let Some(st) = tar.try_wait()? {
                ensure!(st.success(), "tar failed ({st})");
                break true;
            }
            let now = Instant::now();
            if now >= deadline {
                break false;
            }
            if now >= next {
                let b = rchar().unwrap_or(last);
                per_s.push((b - last) as f64 / 1e6);
                last = b;
                next += Duration::from_secs(1);
            }
            std::thread::sleep(Duration::from_millis(20).min(next.saturating_duration_since(now)));
        };
        let bytes = if finished {
            self.tree_bytes()
        } else {
            let b = rchar().unwrap_or(last);
            let _ = tar.kill();
            let _ = tar.wait();
            b
        };
        let elapsed = t0.elapsed().as_secs_f64().min(secs);
        let mut digest = String::new();
        if let Some(mut o) = sum.stdout.take() {
            let _ = o.read_to_string(&mut digest);
        }
        let _ = sum.wait();
        Ok(AppRun {
            value: bytes as f64 / 1e6 / elapsed,
            elapsed_s: elapsed,
            per_s,
            p50_ms: None,
            p99_ms: None,
            first_request_unix_s,
            server_start_s: 0.0,
            extra: json!({"bytes": bytes, "finished": finished, "tree_bytes": self.tree_bytes()}),
        })
    }

    fn tree_bytes(&self) -> u64 {
        (TREE_DIRS * TREE_FILES * TREE_FILE_BYTES) as u64
    }
}

impl Default for Apps {
    fn default() -> Self {
        Apps::new()
    }
}

fn stop_pg_server(mut server: Child) -> Result<()> {
    // SIGINT: PostgreSQL's fast shutdown (clients disconnected, a checkpoint written).
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .context("stopping postgres")?;
    let st = server.wait()?;
    ensure!(st.success(), "postgres stopped with {st}");
    Ok(())
}

fn wait_for_port(port: u16, server: &mut Child) -> Result<()> {
    let t0 = Instant::now();
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        if let Some(st) = server.try_wait()? {
            bail!("the server exited at start with {st}");
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(60),
            "nothing listened on 127.0.0.1:{port} within 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// wrk's durations: "812.00us", "1.23ms", "2.01s".
fn wrk_ms(v: &str) -> Option<f64> {
    let v = v.split_whitespace().next()?;
    let (num, scale) = if let Some(n) = v.strip_suffix("us") {
        (n, 1e-3)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('m') {
        (n, 60e3)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1e3)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|x| x * scale)
}

fn quantile(v: &[f64], q: f64) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    Some(s[((s.len() - 1) as f64 * q).round() as usize])
}

/// pgbench's per-transaction logs (`client tx latency_us script epoch_s epoch_us`): every
/// transaction's latency in ms, and transactions per whole second from `start_unix_s`.
fn pgbench_log(dir: &Path, start_unix_s: f64, secs: u64) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut lat = Vec::new();
    let mut per_s = vec![0.0; secs as usize];
    for e in std::fs::read_dir(dir)? {
        let f = std::fs::File::open(e?.path())?;
        for line in BufReader::new(f).lines() {
            let line = line?;
            let w: Vec<&str> = line.split_whitespace().collect();
            if w.len() < 6 {
                continue;
            }
            let (Ok(us), Ok(s), Ok(sub)) = (
                w[2].parse::<f64>(),
                w[4].parse::<f64>(),
                w[5].parse::<f64>(),
            ) else {
                continue;
            };
            lat.push(us / 1e3);
            let t = s + sub / 1e6 - start_unix_s;
            if t >= 0.0 && (t as usize) < per_s.len() {
                per_s[t as usize] += 1.0;
            }
        }
    }
    Ok((lat, per_s))
}

/// Seconds from `start_unix_s` to the first line of the daemon's log (RFC 3339 UTC
/// timestamps) at or after it that says it keeps or manages one of `comms`, if any (a
/// server's own start-up I/O, before the first request, is not help for a request).
pub fn first_kept_after(log: &str, comms: &[&str], start_unix_s: f64) -> Option<f64> {
    log.lines()
        .filter(|l| l.contains("kept there") || l.contains("managing it"))
        .filter(|l| comms.iter().any(|c| l.contains(&format!("comm={c}"))))
        .filter_map(|l| rfc3339_unix_s(l.split_whitespace().next()?))
        .map(|t| t - start_unix_s)
        .find(|&d| d >= 0.0)
}

/// "2026-11-27T14:30:01.123456Z" as Unix seconds.
fn rfc3339_unix_s(ts: &str) -> Option<f64> {
    let ts = ts.strip_suffix('Z')?;
    let (date, time) = ts.split_once('T')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (hh, mm) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    let ss = t.next()?.parse::<f64>().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + hh * 3600.0 + mm * 60.0 + ss)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_matches_the_unix_clock() {
        assert_eq!(rfc3339_unix_s("1970-01-01T00:00:00Z"), Some(0.0));
        assert_eq!(
            rfc3339_unix_s("2026-11-27T14:30:01.500000Z"),
            Some(1_795_789_801.5)
        );
        assert_eq!(
            rfc3339_unix_s("2024-02-29T00:00:00Z"),
            Some(1_709_164_800.0)
        );
    }

    #[test]
    fn wrk_durations() {
        assert_eq!(wrk_ms("812.00us"), Some(0.812));
        assert_eq!(wrk_ms("1.50ms"), Some(1.5));
        assert_eq!(wrk_ms("2.00s"), Some(2000.0));
    }

    #[test]
    fn the_first_keep_of_the_applications_tasks() {
        let log = "2026-11-27T14:30:01.000000Z  INFO x: task is I/O-bound: managing it tid=7 comm=vmigrater-work\n\
                   2026-11-27T14:30:02.250000Z  INFO x: its requests complete on vCPU 1 wherever it submits: kept there tid=9 comm=postgres cpu=1\n";
        let start = rfc3339_unix_s("2026-11-27T14:30:02.000000Z").unwrap();
        assert_eq!(first_kept_after(log, &["postgres"], start), Some(0.25));
        assert_eq!(first_kept_after(log, &["nginx"], start), None);
    }
}
