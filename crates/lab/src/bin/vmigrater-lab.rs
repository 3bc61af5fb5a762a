//! `vmigrater-lab`: boots a lab VM by hand (`shell`) and runs the benefit benchmark
//! (`bench`, see `make bench-lab`).

use anyhow::{bail, Context, Result};
use lab::image::{self, Contents, Kernel};
use lab::vm::{Vm, VmSpec};
use std::path::PathBuf;
use std::time::Duration;

fn main() {
    if let Err(e) = run() {
        eprintln!("vmigrater-lab: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("shell") => shell(&args[1..]),
        _ => bail!("usage: vmigrater-lab shell BIN_DIR [COMMAND...]"),
    }
}

/// Boots a 2-vCPU VM with the binaries of BIN_DIR and runs each COMMAND in it.
fn shell(args: &[String]) -> Result<()> {
    let bins = PathBuf::from(args.first().context("BIN_DIR")?);
    let lab = image::lab_dir();
    let kernel = Kernel::find(&lab)?;
    let dir = lab.join("run/shell");
    std::fs::create_dir_all(&dir)?;
    let contents = Contents {
        binaries: ["vmigrater", "vmigrater-workload"]
            .iter()
            .map(|b| (bins.join(b), b.to_string()))
            .collect(),
        files: vec![],
    };
    let img = image::build(&kernel, &contents, &dir.join("initrd.cpio"))?;
    let disk = lab.join("disk-64m.img");
    lab::host::make_disk(&disk, 64)?;
    let spec = VmSpec {
        name: "shell".into(),
        vcpus: 2,
        mem_mb: 512,
        disk,
    };
    let t0 = std::time::Instant::now();
    let mut vm = Vm::start(&spec, &img, &dir)?;
    vm.wait_ready(Duration::from_secs(120))?;
    eprintln!(
        "ready after {:?}; vCPU threads {:?}",
        t0.elapsed(),
        vm.vcpu_threads()?
    );
    for c in &args[1..] {
        let (rc, out) = vm.sh_rc(c, Duration::from_secs(300))?;
        println!("$ {c}\n{out}[exit {rc}]");
    }
    vm.stop();
    Ok(())
}
