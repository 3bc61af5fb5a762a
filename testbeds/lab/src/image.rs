//! The guest: a Debian kernel (unpacked by scripts/lab-setup.sh, never installed on the
//! host) and an initramfs with busybox, the virtio modules, our binaries with the shared
//! libraries they link, and the init + command agent from `guest/`.

use crate::cpio::Archive;
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The modules the guest needs, in load order (see guest/init): virtio, then what an
/// ext4 root needs (the systemd guest of the install test).
pub const MODULES: [&str; 12] = [
    "virtio_ring",
    "virtio",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "virtio_blk",
    "virtio_console",
    "crc16",
    "mbcache",
    "jbd2",
    "crc32c_generic",
    "ext4",
];

const INIT: &str = include_str!("../guest/init");
const AGENT: &str = include_str!("../guest/agent.sh");

/// Where the lab keeps its kernel, images, disks and run directories: `VMIGRATER_LAB_DIR`
/// or `target/lab` of this workspace.
pub fn lab_dir() -> PathBuf {
    match std::env::var_os("VMIGRATER_LAB_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/lab"),
    }
}

pub struct Kernel {
    pub vmlinuz: PathBuf,
    /// `lib/modules/<release>` of the unpacked package.
    pub modules: PathBuf,
    pub release: String,
}

impl Kernel {
    /// The kernel scripts/lab-setup.sh unpacked under `<lab>/kernel`.
    pub fn find(lab: &Path) -> Result<Kernel> {
        let root = lab.join("kernel");
        let boot = root.join("boot");
        let vmlinuz = std::fs::read_dir(&boot)
            .with_context(|| {
                format!(
                    "no guest kernel under {}: run scripts/lab-setup.sh (make test does)",
                    boot.display()
                )
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
            })
            .with_context(|| format!("no vmlinuz-* in {}", boot.display()))?;
        let release = vmlinuz
            .file_name()
            .unwrap()
            .to_string_lossy()
            .trim_start_matches("vmlinuz-")
            .to_string();
        let modules = root.join("lib/modules").join(&release);
        if !modules.is_dir() {
            bail!(
                "{} is missing: the kernel package is incomplete",
                modules.display()
            );
        }
        Ok(Kernel {
            vmlinuz,
            modules,
            release,
        })
    }

    fn module(&self, name: &str) -> Result<PathBuf> {
        let mut stack = vec![self.modules.join("kernel")];
        let file = format!("{name}.ko");
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir)? {
                let p = e?.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.file_name().is_some_and(|n| n == file.as_str()) {
                    return Ok(p);
                }
            }
        }
        bail!("module {file} not in {}", self.modules.display())
    }
}

/// What goes into the guest besides the fixed parts.
#[derive(Default)]
pub struct Contents {
    /// Host binaries, copied to /bin/<name> (a name may hold a directory) with their
    /// shared libraries.
    pub binaries: Vec<(PathBuf, String)>,
    /// Extra files: (guest path, contents).
    pub files: Vec<(String, String)>,
}

pub struct Image {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
}

/// Writes `out` (the initramfs) and returns the image to boot.
pub fn build(kernel: &Kernel, contents: &Contents, out: &Path) -> Result<Image> {
    let f = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut a = Archive::new(std::io::BufWriter::new(f));
    let mut dirs = BTreeSet::new();
    let mut mkdirs = |a: &mut Archive<_>, path: &str| -> Result<()> {
        let mut at = String::new();
        for part in path
            .trim_start_matches('/')
            .split('/')
            .filter(|p| !p.is_empty())
        {
            at.push('/');
            at.push_str(part);
            if dirs.insert(at.clone()) {
                a.dir(&at)?;
            }
        }
        Ok(())
    };
    for d in [
        "/bin",
        "/dev",
        "/proc",
        "/sys",
        "/run",
        "/tmp",
        "/etc",
        "/lab",
        "/lib/modules",
    ] {
        mkdirs(&mut a, d)?;
    }
    a.file("/init", 0o755, INIT.as_bytes())?;
    a.file("/lab/agent.sh", 0o644, AGENT.as_bytes())?;
    let busybox = Path::new("/bin/busybox");
    a.file("/bin/busybox", 0o755, &read(busybox)?)?;
    for m in MODULES {
        a.file(
            &format!("/lib/modules/{m}.ko"),
            0o644,
            &read(&kernel.module(m)?)?,
        )?;
    }
    let mut libs = BTreeSet::new();
    for (bin, name) in &contents.binaries {
        let path = format!("/bin/{name}");
        mkdirs(&mut a, Path::new(&path).parent().unwrap().to_str().unwrap())?;
        a.file(&path, 0o755, &read(bin)?)?;
        libs.extend(shared_libs(bin)?);
    }
    for lib in libs {
        let path = lib.to_string_lossy().to_string();
        mkdirs(&mut a, Path::new(&path).parent().unwrap().to_str().unwrap())?;
        // The real file's bytes under the name the loader asks for (links resolved).
        a.file(&path, 0o755, &read(&lib)?)?;
    }
    for (path, text) in &contents.files {
        mkdirs(&mut a, Path::new(path).parent().unwrap().to_str().unwrap())?;
        a.file(path, 0o644, text.as_bytes())?;
    }
    a.finish()?;
    Ok(Image {
        kernel: kernel.vmlinuz.clone(),
        initrd: out.to_path_buf(),
    })
}

fn read(p: &Path) -> Result<Vec<u8>> {
    std::fs::read(p).with_context(|| format!("reading {}", p.display()))
}

/// The shared libraries `bin` loads (with the loader), from `ldd`.
fn shared_libs(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = std::process::Command::new("ldd")
        .arg(bin)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if text.contains("not a dynamic executable") {
        return Ok(Vec::new());
    }
    Ok(parse_ldd(&text))
}

fn parse_ldd(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_libraries_and_the_loader() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibelf.so.1 => /lib/x86_64-linux-gnu/libelf.so.1 (0x00007f)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            parse_ldd(text),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libelf.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
    }
}
