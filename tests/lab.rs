//! The nested-VM lab end to end (issue 4): a real guest under QEMU TCG whose vCPUs are host
//! threads, descheduled by host CPU hogs that stand in for a co-located VM, with the
//! paper's 11 ms hypervisor slice on every competing thread. Inside, `vmigrater` runs with
//! an O_DIRECT reader on the virtio disk and two CPU hogs; on the host,
//! `vmigrater-hv-agent` reads the guest's reports from the VM's hint socket and finds the
//! vCPU threads through QMP. Asserted from the guest's and the host's kernels: deschedules
//! detected (by the kernel-timer source: the host's slices seen as late guest timers), the reader classified and migrated, reports delivered, the agent's weight
//! applied to the right vCPU threads and restored after it stops. Root only; the guest
//! kernel and QEMU come from scripts/lab-setup.sh (`make test` runs it).

use lab::bench::HOST_SLICE_NS;
use lab::guest::{self, daemon_status};
use lab::image::{self, Contents, Kernel};
use lab::vm::{Vm, VmSpec};
use serde_json::Value;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmigrater_testbed::host::{nice_of, Agent, Hogs};
use vmigrater_testbed::{assert_root, workspace_bin};

/// What the host was doing while a guest did not answer: its load, the steal of this
/// machine's own host, each vCPU thread's nice and run/wait so far, every QEMU thread's
/// state and where in the kernel it sleeps, then the guest's serial log's end
/// (`Vm::log_tail`). Guests frozen for minutes were seen in full runs of this binary, with
/// both vCPU threads neither running nor waiting for a CPU (blocked in QEMU, while the
/// guest's own hogs had work): the thread states say on what.
fn host_picture(vcpus: &[u32], serial_tail: &str) -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let steal: Vec<String> = read("/proc/stat")
        .lines()
        .filter(|l| l.starts_with("cpu"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            format!("{} steal {}", f[0], f.get(8).unwrap_or(&"?"))
        })
        .collect();
    let threads: Vec<String> = vcpus
        .iter()
        .map(|&t| {
            format!(
                "vCPU thread {t}: nice {}, schedstat (run ns, wait ns, slices) {}",
                nice_of(t),
                read(&format!("/proc/{t}/schedstat")).trim()
            )
        })
        .collect();
    // The QEMU process: the vCPU threads' thread group.
    let tgid = vcpus.first().and_then(|t| {
        read(&format!("/proc/{t}/status"))
            .lines()
            .find_map(|l| l.strip_prefix("Tgid:").map(|v| v.trim().to_string()))
    });
    let mut qemu = Vec::new();
    if let Some(pid) = tgid {
        if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            for t in dir.flatten() {
                let base = t.path();
                let at = |f: &str| read(&base.join(f).to_string_lossy());
                // stat: "tid (comm) S ..."; the state follows the last ')'.
                let stat = at("stat");
                let state = stat
                    .rsplit_once(')')
                    .and_then(|(_, r)| r.split_whitespace().next().map(str::to_string))
                    .unwrap_or_default();
                qemu.push(format!(
                    "  {} {}: state {state}, wchan {}, syscall {}",
                    t.file_name().to_string_lossy(),
                    at("comm").trim(),
                    at("wchan").trim(),
                    at("syscall").split_whitespace().next().unwrap_or("?")
                ));
            }
        }
    }
    format!(
        "loadavg {}; {}\n{}\nQEMU threads:\n{}\nserial log, last lines:\n{}",
        read("/proc/loadavg").trim(),
        steal.join(", "),
        threads.join("\n"),
        qemu.join("\n"),
        serial_tail
    )
}

fn slice_of(tid: u32) -> u64 {
    os_layer::sched::get_attr(tid)
        .map(|a| a.sched_runtime)
        .unwrap_or(0)
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn guest_daemon_and_host_agent_work_in_a_real_vm() {
    assert_root();
    // A guest that froze (it stopped answering through two waits; the host's picture is
    // printed each time) is run once more from a fresh boot, loudly. Such freezes hit the
    // daemon of the build before this one as well as this one's, in full runs of this
    // binary only, with both vCPU threads neither running nor waiting for a CPU (blocked
    // in QEMU) while the guest's own hogs had work. Every other failure, and a second
    // freeze, fails the test.
    if let Err(frozen) = e2e_scenario() {
        eprintln!(
            "RETRYING ONCE: the guest froze; what the host saw:\n{frozen}\n--- a fresh boot ---"
        );
        if let Err(again) = e2e_scenario() {
            panic!("the guest froze twice; the second time the host saw:\n{again}");
        }
    }
}

/// Watches threads' nice values from a thread of its own until dropped: whether any was
/// ever changed.
struct NiceWatch {
    seen: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl NiceWatch {
    fn start(tids: Vec<u32>) -> NiceWatch {
        let (seen, stop) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let handle = {
            let (seen, stop) = (seen.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if tids.iter().any(|&t| nice_of(t) != 0) {
                        seen.store(true, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        NiceWatch {
            seen,
            stop,
            handle: Some(handle),
        }
    }

    fn seen(&self) -> bool {
        self.seen.load(Ordering::Relaxed)
    }
}

impl Drop for NiceWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Whether the agent's status of a VM shows a favour its rules would pay for: a vCPU that
/// carries the VM's I/O beside one free of it that never halts (`weights::fund`).
fn favour_payable(vm: &Value) -> bool {
    let vcpus = vm["vcpus"].as_array().cloned().unwrap_or_default();
    let flag = |v: &Value, k: &str| v[k].as_bool().unwrap_or(false);
    vcpus.iter().any(|v| flag(v, "carries_io"))
        && vcpus
            .iter()
            .any(|v| flag(v, "io_free") && flag(v, "always_runnable") && !flag(v, "carries_io"))
}

/// The end-to-end scenario; `Err` with the host's picture when the guest froze.
fn e2e_scenario() -> Result<(), String> {
    let lab = image::lab_dir();
    let kernel = Kernel::find(&lab).expect("guest kernel (scripts/lab-setup.sh)");
    let dir = lab.join("run/e2e");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let contents = Contents {
        binaries: ["vmigrater", "vmigrater-workload"]
            .iter()
            .map(|b| (workspace_bin(b), b.to_string()))
            .collect(),
        // The kernel-timer source, insisted on so that a silent fallback to the sleepers
        // fails the test. No move guard: this test checks that the migration mechanism
        // works on real vCPUs; whether moves pay is the guard's business (unit-tested)
        // and the benchmark's (`make bench-lab`).
        files: vec![(
            "/etc/vmigrater/vmigrater.toml".to_string(),
            "[monitor]\nsource = \"kernel\"\n\n[migration]\nguard = false\n".to_string(),
        )],
    };
    let img = image::build(&kernel, &contents, &dir.join("initrd.cpio")).unwrap();
    let disk = lab.join("disk-64m.img");
    lab::host::make_disk(&disk, 64).unwrap();
    let spec = VmSpec {
        name: "lab".into(),
        vcpus: 2,
        mem_mb: 512,
        disk,
        kernel_args: String::new(),
    };
    let t0 = Instant::now();
    let mut vm = Vm::boot(&spec, &img, &dir, Duration::from_secs(300)).unwrap();
    let vcpus = vm.vcpu_threads().unwrap();
    eprintln!("booted in {:.1?}; vCPU threads {vcpus:?}", t0.elapsed());
    assert_eq!(vcpus.len(), 2);

    // One vCPU per host CPU, each sharing it with a hog (the co-located VM), all with the
    // paper's 11 ms slice: each vCPU is descheduled for ~11 ms at a time.
    let hogs = Hogs::start(&[0, 1]);
    for (i, &t) in vcpus.iter().enumerate() {
        lab::host::pin(t, i).unwrap();
    }
    for &t in vcpus.iter().chain(&hogs.tids) {
        lab::host::set_slice(t, HOST_SLICE_NS).unwrap();
    }
    // The hogs are configured as the co-located VM, so that the default share rule has a
    // neighbour to trade with: the lab vCPU carrying the reader gains weight on its host
    // CPU, paid for by the other lab vCPU on the other one, and the agent visibly acts on
    // the threads QMP named.
    let neighbour = hogs
        .tids
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let agent = Agent::start(
        &dir,
        &format!(
            "[[vm]]\nname = \"lab\"\nhint_socket = {:?}\nqmp_socket = {:?}\n\n[[vm]]\nname = \"neighbour\"\nvcpu_threads = [{neighbour}]\n",
            vm.hint.display().to_string(),
            vm.qmp.display().to_string()
        ),
    );

    let t1 = Instant::now();
    guest::start_daemon(&mut vm, false).expect("guest daemon did not come up");
    eprintln!("guest daemon up after {:.1?}", t1.elapsed());

    vm.sh(
        "setsid vmigrater-workload --file /dev/vda --readers 1 --hogs 2 --duration-ms 30000 \
         </dev/null >/tmp/workload.json 2>/tmp/workload.json.err &",
        Duration::from_secs(10),
    )
    .unwrap();
    // Any weight the agent gives a vCPU thread from here on, whenever it comes: a slow
    // guest's workload outlives its nominal 30 s, and the main thread spends that time
    // blocked on reading its result (CI: a favour came while it waited, and ended unseen).
    let watch = NiceWatch::start(vcpus.clone());
    // Mid-run: the reader is classified and placed by the daemon, and the agent has
    // guest reports for the vCPU threads QMP names. The agent's view is per period (a
    // period without a report shows no events), so it is polled, not sampled once.
    std::thread::sleep(Duration::from_secs(6));
    let placed_reader = |status: &Value| {
        status["tasks"].as_array().is_some_and(|tasks| {
            tasks.iter().any(|t| {
                t["comm"].as_str().unwrap_or("").starts_with("reader") && !t["placed_on"].is_null()
            })
        })
    };
    // A guest too slow to answer now is asked again every second below (CI: no answer
    // at 6 s on a loaded machine); only the checks at the end need its answer.
    let mut mid = daemon_status(&mut vm).unwrap_or(Value::Null);
    let mut reader_placed = placed_reader(&mid);
    let mut host_mid = Value::Null;
    let mut from_guest = false;
    // Whether the agent's rules let it favour a vCPU at some period: one vCPU of the lab
    // VM carried its I/O while another was free of it and never halted, so could pay
    // (`vm-funded`). Where the daemon keeps the reader on one vCPU and its requests
    // complete on the other, both carry the VM's I/O and no favour is due.
    let mut payable = false;
    let t_mid = Instant::now();
    let mut last_guest_look = Instant::now();
    // Up to the workload's last seconds: sampled tracking sees I/O in 250 ms of every 2.5 s,
    // so on a slow machine (CI runs saw none in 8 s, and twice none in 12 s) a window may
    // pass between them;
    // for the same reason one look at the guest at 6 s may come before the reader's first
    // placement (seen twice on a loaded machine), so the guest is asked again every second.
    while t_mid.elapsed() < Duration::from_secs(22)
        && !(from_guest && watch.seen() && reader_placed)
    {
        if !reader_placed && last_guest_look.elapsed() >= Duration::from_secs(1) {
            last_guest_look = Instant::now();
            if let Some(s) = daemon_status(&mut vm) {
                reader_placed = placed_reader(&s);
                mid = s;
            }
        }
        host_mid = agent.status().expect("agent status mid-run");
        from_guest |= host_mid["vms"][0]["vcpus"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["source"] == "guest" && v["events"].as_u64().unwrap_or(0) > 0);
        payable |= favour_payable(&host_mid["vms"][0]);
        std::thread::sleep(Duration::from_millis(50));
    }
    // A guest that stops answering for a minute gets one more wait, the host's picture
    // printed in between; the late answer to the same `cat` is what the retry reads.
    let workload = guest::read_json(&mut vm, "/tmp/workload.json", Duration::from_secs(120))
        .or_else(|e| {
            eprintln!(
                "the guest did not answer ({e:#}); the host meanwhile:\n{}",
                host_picture(&vcpus, &vm.log_tail())
            );
            guest::read_json(&mut vm, "/tmp/workload.json", Duration::from_secs(120))
        });
    let workload = match workload {
        Ok(w) => w,
        Err(e) => {
            return Err(format!(
                "workload did not finish: {e:#}\n{}",
                host_picture(&vcpus, &vm.log_tail())
            ))
        }
    };
    // The agent weights the I/O vCPU's thread from the guest's reports, paid only by a
    // vCPU that carried no I/O-bound task for 8 periods. The daemon moves the reader
    // between the two vCPUs, so that may first hold as the reader settles or stops (CI:
    // none in 22 s, nice -2 in the status taken just after the workload). The threads are
    // watched for a few more seconds, with the VM and the agent still running.
    let t_end = Instant::now();
    while !watch.seen() && t_end.elapsed() < Duration::from_secs(10) {
        if let Some(h) = agent.status() {
            payable |= favour_payable(&h["vms"][0]);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let io_vcpu_tweaked = watch.seen();
    drop(watch);
    let end = daemon_status(&mut vm).expect("guest status");
    let host = agent.status().expect("agent status");
    eprintln!("workload: {workload}");
    eprintln!("guest mid-run tasks: {}", mid["tasks"]);
    eprintln!(
        "guest: vcpus {} migrations {} reports {} replies {}",
        end["vcpus"], end["migrations"], end["channel_reports_sent"], end["channel_replies"]
    );
    eprintln!("host: {}", host["vms"]);

    // The daemon saw its vCPUs descheduled (by the host, invisibly to the guest kernel).
    let deschedules: u64 = end["vcpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["deschedules"].as_u64().unwrap())
        .sum();
    assert!(deschedules > 0, "no deschedules detected: {}", end["vcpus"]);
    assert_eq!(
        end["monitor_source"], "kernel",
        "late kernel timers are the source"
    );
    // The reader was classified I/O-bound and placed, and moved between vCPUs.
    assert!(
        reader_placed,
        "reader not managed mid-run: {}",
        mid["tasks"]
    );
    assert!(end["migrations"].as_u64().unwrap() > 0, "no migrations");
    let reader = &workload["readers"][0];
    assert!(reader["reads"].as_u64().unwrap() > 100, "reader: {reader}");
    assert!(
        reader["migrations"].as_u64().unwrap_or(0) > 0,
        "the reader never moved: {reader}"
    );
    // Reports crossed the virtio port and the agent used them for the right threads.
    assert!(end["channel_reports_sent"].as_u64().unwrap() > 0);
    assert!(
        end["channel_replies"].as_u64().unwrap() > 0,
        "no host replies"
    );
    let vm_status = &host["vms"][0];
    assert_eq!(vm_status["name"], "lab");
    assert!(vm_status["reports"].as_u64().unwrap() > 0, "{vm_status}");
    let tids: Vec<u64> = vm_status["vcpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["tid"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(
        tids,
        vcpus.iter().map(|&t| t as u64).collect::<Vec<_>>(),
        "agent's vCPU threads are not QMP's"
    );
    assert!(
        from_guest,
        "no vCPU with guest-reported I/O: {}",
        host_mid["vms"]
    );
    if payable {
        assert!(
            io_vcpu_tweaked,
            "a vCPU could pay for its sibling's I/O and no vCPU thread had its nice changed: {}",
            host_mid["vms"]
        );
    } else if !io_vcpu_tweaked {
        // The agent's rules held it back the whole run; their outcome on real threads is
        // asserted every run by tests/hv_agent.rs (the favour and who pays for it).
        eprintln!(
            "\n******** NOT EXERCISED: no vCPU of the guest was ever free of its I/O while \
             another carried it (the reader sat apart from its completions), so the agent \
             owed no favour and changed no weight; host: {} ********\n",
            host_mid["vms"]
        );
    }

    let log = agent.terminate();
    let rejects: Vec<&str> = log.lines().filter(|l| l.contains("reject")).collect();
    eprintln!("agent rejections: {rejects:#?}");
    assert_eq!(vm_status["rejected"], 0, "{vm_status}");
    for &t in vcpus.iter().chain(&hogs.tids) {
        assert_eq!(nice_of(t), 0, "nice of vCPU thread {t} not restored");
        // The lab's slice is somebody else's: the agent's nice changes keep it.
        assert_eq!(
            slice_of(t),
            HOST_SLICE_NS,
            "slice of vCPU thread {t} changed"
        );
    }
    drop(hogs);
    vm.stop();
    Ok(())
}

/// Issue 11's fault-injection pass, each fault once, with both programs in the main
/// scenario while VM A's I/O streams (`vmigrater-lab soak` runs the same for an hour):
/// the agent SIGKILLed and started again (the next one puts back what it left changed),
/// the agent restarted with SIGTERM (every vCPU thread back to what the lab set before the
/// next start), the virtio port hot-unplugged and plugged back under the guest daemon. After
/// each, the guest and the agent must talk again within `RECONNECT_LIMIT`; memory and
/// descriptors stay within the budget.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn both_programs_ride_out_agent_kills_restarts_and_a_port_replug() {
    assert_root();
    let bin_dir = workspace_bin("vmigrater")
        .parent()
        .expect("bin dir")
        .to_path_buf();
    let opts = lab::soak::SoakOptions {
        name: "faults",
        bin_dir,
        duration: Duration::from_secs(90),
        sample_every: Duration::from_secs(10),
        fault_every: Duration::from_secs(25),
    };
    let _peers = lab::bench::AutogroupOff::new().expect("autogroup");
    let doc = lab::soak::soak(&opts, lab::GUEST_CONFIG).expect("soak");
    eprintln!("faults: {:#}", doc["faults"]);
    eprintln!("verdict: {:#}", doc["verdict"]);
    let faults = doc["faults"].as_array().unwrap();
    let kinds: Vec<&str> = faults.iter().filter_map(|f| f["kind"].as_str()).collect();
    assert_eq!(kinds, lab::soak::FAULTS, "{faults:#?}");
    for f in faults {
        assert!(
            f["reconnect_s"].as_f64().is_some_and(|s| s.is_finite()),
            "{f:#}"
        );
    }
    assert_eq!(
        doc["verdict"]["failures"].as_array().map(Vec::len),
        Some(0),
        "{:#}",
        doc["verdict"]
    );
}
