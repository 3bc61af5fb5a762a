//! What the packages ship besides the binary, generated from the binary's own clap
//! definition so they never drift from `--help`: man pages (`man/*.8`, one for the program
//! and one per visible subcommand) and shell completions (`completions/` for bash, zsh and
//! fish). Called by each binary's hidden `gen-dist` subcommand; it only writes under `dir`.

use anyhow::{Context, Result};
use clap_complete::Shell;
use std::path::{Path, PathBuf};

/// Man section of both programs: they are system administration daemons.
pub const MAN_SECTION: &str = "8";

/// Writes `dir/man/<name>[-<sub>].8` and `dir/completions/{<name>.bash,_<name>,<name>.fish}`
/// and returns the files written.
pub fn write(cmd: clap::Command, dir: &Path) -> Result<Vec<PathBuf>> {
    let mut cmd = cmd.disable_help_subcommand(true);
    // After `build`, subcommands carry display names like `vmigrater-run` (git's style).
    cmd.build();
    let name = cmd.get_name().to_string();
    let man_dir = dir.join("man");
    let comp_dir = dir.join("completions");
    for d in [&man_dir, &comp_dir] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let mut written = Vec::new();
    let mut pages = vec![cmd.clone()];
    pages.extend(cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned());
    for page in pages {
        let man = clap_mangen::Man::new(page).section(MAN_SECTION);
        let path = man
            .generate_to(&man_dir)
            .with_context(|| format!("writing a man page to {}", man_dir.display()))?;
        written.push(path);
    }
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let path = clap_complete::generate_to(shell, &mut cmd, &name, &comp_dir)
            .with_context(|| format!("writing {shell} completion to {}", comp_dir.display()))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_pages_and_completions_without_hidden_commands() {
        let cmd = clap::Command::new("demo")
            .about("A demo daemon")
            .subcommand(clap::Command::new("run").about("Run it"))
            .subcommand(clap::Command::new("gen-dist").hide(true));
        let dir = tempfile::tempdir().unwrap();
        let files = write(cmd, dir.path()).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.strip_prefix(dir.path()).unwrap().display().to_string())
            .collect();
        assert_eq!(
            names,
            [
                "man/demo.8",
                "man/demo-run.8",
                "completions/demo.bash",
                "completions/_demo",
                "completions/demo.fish"
            ]
        );
        let page = std::fs::read_to_string(dir.path().join("man/demo.8")).unwrap();
        assert!(page.contains(".TH demo 8"), "{page}");
        assert!(!page.contains("gen-dist"), "hidden command leaked: {page}");
        let bash = std::fs::read_to_string(dir.path().join("completions/demo.bash")).unwrap();
        assert!(bash.contains("run"), "{bash}");
    }
}
