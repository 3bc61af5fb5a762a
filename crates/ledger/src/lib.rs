//! The change ledger both programs keep: per thread, the original of everything they
//! change (a CPU mask in the guest; nice, slice, mask, cgroup weight on the host), written
//! to disk *before* the change, so that a clean exit restores it and, after SIGKILL, an
//! OOM kill or a panic, the next start does.
//!
//! It owns the file and nothing else: a versioned JSON file replaced atomically (temp
//! file in the same directory, fsync, rename, fsync the directory), so a reader sees the
//! old or the new ledger, never half of one. It never loses a record it has not been told
//! to drop: a change whose record cannot be written is not kept in memory either (the
//! caller must not make it), and a file it cannot read is moved aside (`<name>.corrupt`,
//! then `.corrupt.1`, …, never overwritten) for a person to restore by hand. What "the
//! same thread" and "still our change" mean is the caller's: each entry carries what
//! tells (start time, what was last set).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// An entry of the ledger: the thread it is about.
pub trait Keyed {
    fn tid(&self) -> u32;
}

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("{action} the {what} {}: {source}", path.display())]
    Io {
        action: &'static str,
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the {what} {} is corrupt ({reason}); it was moved aside to {} so the originals it \
         lists can still be restored by hand",
        path.display(),
        aside.display()
    )]
    Corrupt {
        what: &'static str,
        path: PathBuf,
        aside: PathBuf,
        reason: String,
    },
}

pub type Result<T> = std::result::Result<T, LedgerError>;

fn io_err<'a>(
    action: &'static str,
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> LedgerError + 'a {
    move |source| LedgerError::Io {
        action,
        what,
        path: path.to_path_buf(),
        source,
    }
}

#[derive(Serialize, Deserialize)]
struct FileFormat<E> {
    version: u32,
    entries: Vec<E>,
}

/// Reads a file of an older layout; `None`: not that layout either.
pub type LegacyReader<E> = fn(&[u8]) -> Option<Vec<E>>;

/// How a ledger's file is read: its format version, what to call it in errors, and an
/// optional reader for an older layout (a file from before this format).
pub struct Format<E> {
    pub version: u32,
    pub what: &'static str,
    pub legacy: Option<LegacyReader<E>>,
}

impl<E> Clone for Format<E> {
    fn clone(&self) -> Self {
        Format {
            version: self.version,
            what: self.what,
            legacy: self.legacy,
        }
    }
}

/// The ledger in memory, mirrored to its file on every change.
#[derive(Debug)]
pub struct Ledger<E> {
    path: PathBuf,
    version: u32,
    what: &'static str,
    entries: BTreeMap<u32, E>,
}

impl<E: Keyed + Clone + Serialize + DeserializeOwned> Ledger<E> {
    /// Opens (or starts) the ledger at `path`, creating its directory, and writes it once,
    /// so that a read-only or missing state directory fails at start, not mid-run. Entries
    /// already in the file are kept (a crashed run's, for `previous` to restore first).
    pub fn open(path: impl AsRef<Path>, format: &Format<E>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if let Some(dir) = parent_dir(&path) {
            fs::create_dir_all(dir).map_err(io_err(
                "creating the directory of",
                format.what,
                dir,
            ))?;
        }
        let entries = read(&path, format)?
            .unwrap_or_default()
            .into_iter()
            .map(|e| (e.tid(), e))
            .collect();
        let ledger = Ledger {
            path,
            version: format.version,
            what: format.what,
            entries,
        };
        ledger.persist()?;
        Ok(ledger)
    }

    /// A ledger that starts empty and writes nothing until its first change.
    pub fn fresh(path: impl AsRef<Path>, format: &Format<E>) -> Self {
        Ledger {
            path: path.as_ref().to_path_buf(),
            version: format.version,
            what: format.what,
            entries: BTreeMap::new(),
        }
    }

    /// What a previous run left at `path` (`None`: no file). A file that cannot be read is
    /// moved aside and reported as `Corrupt`.
    pub fn previous(path: impl AsRef<Path>, format: &Format<E>) -> Result<Option<Vec<E>>> {
        read(path.as_ref(), format)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn get(&self, tid: u32) -> Option<&E> {
        self.entries.get(&tid)
    }

    pub fn entries(&self) -> impl Iterator<Item = &E> {
        self.entries.values()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Puts `entry` in (replacing one for the same thread) and writes the file; when the
    /// write fails, memory goes back to what it was and the caller must not make the change.
    pub fn insert(&mut self, entry: E) -> Result<Option<E>> {
        let tid = entry.tid();
        let old = self.entries.insert(tid, entry);
        match self.persist() {
            Ok(()) => Ok(old),
            Err(e) => {
                match old {
                    Some(old) => self.entries.insert(tid, old),
                    None => self.entries.remove(&tid),
                };
                Err(e)
            }
        }
    }

    /// Drops `tid`'s entry (restored, or no longer ours to restore) and writes the file.
    pub fn remove(&mut self, tid: u32) -> Result<Option<E>> {
        let Some(old) = self.entries.remove(&tid) else {
            return Ok(None);
        };
        match self.persist() {
            Ok(()) => Ok(Some(old)),
            Err(e) => {
                self.entries.insert(tid, old);
                Err(e)
            }
        }
    }

    /// Everything was restored: the file goes.
    pub fn clear(&mut self) -> Result<()> {
        self.entries.clear();
        match fs::remove_file(&self.path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(io_err("removing", self.what, &self.path)(e))
            }
            _ => Ok(()),
        }
    }

    /// Writes an empty ledger over what `previous` returned, once its entries are dealt with.
    pub fn empty_file(path: impl AsRef<Path>, format: &Format<E>) -> Result<()> {
        Ledger::<E>::fresh(path, format).persist()
    }

    fn persist(&self) -> Result<()> {
        let file = FileFormat {
            version: self.version,
            entries: self.entries.values().cloned().collect(),
        };
        let bytes = serde_json::to_vec_pretty(&file).expect("ledger entries always serialize");
        write_atomically(&self.path, &bytes, self.what)
    }
}

fn parent_dir(path: &Path) -> Option<&Path> {
    path.parent().filter(|p| !p.as_os_str().is_empty())
}

/// The file's entries, one per thread. Only a hand-edited or damaged file names a thread
/// twice (ours are written from a map); the first entry is kept, since for a thread that
/// was changed twice it is the one that holds what the thread had before us.
fn read<E: Keyed + DeserializeOwned>(path: &Path, format: &Format<E>) -> Result<Option<Vec<E>>> {
    Ok(read_all(path, format)?.map(|entries| {
        let mut seen = std::collections::HashSet::new();
        entries
            .into_iter()
            .filter(|e| seen.insert(e.tid()))
            .collect()
    }))
}

fn read_all<E: DeserializeOwned>(path: &Path, format: &Format<E>) -> Result<Option<Vec<E>>> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("reading", format.what, path)(e)),
    };
    let reason = match serde_json::from_slice::<FileFormat<E>>(&bytes) {
        Ok(f) if f.version == format.version => return Ok(Some(f.entries)),
        Ok(f) => format!("unknown format version {}", f.version),
        Err(e) => match format.legacy.and_then(|legacy| legacy(&bytes)) {
            Some(entries) => return Ok(Some(entries)),
            None => e.to_string(),
        },
    };
    let aside = corrupt_aside(path);
    fs::rename(path, &aside).map_err(io_err("moving aside the corrupt", format.what, path))?;
    Err(LedgerError::Corrupt {
        what: format.what,
        path: path.to_path_buf(),
        aside,
        reason,
    })
}

/// `<path>.corrupt`, or `<path>.corrupt.N` when earlier ones are still there.
fn corrupt_aside(path: &Path) -> PathBuf {
    let with = |suffix: String| {
        let mut s = path.as_os_str().to_owned();
        s.push(suffix);
        PathBuf::from(s)
    };
    std::iter::once(with(".corrupt".into()))
        .chain((1..).map(|n| with(format!(".corrupt.{n}"))))
        .find(|p| !p.exists())
        .expect("some suffix is free")
}

fn write_atomically(path: &Path, bytes: &[u8], what: &'static str) -> Result<()> {
    let dir = parent_dir(path).unwrap_or(Path::new("."));
    let mut tmp_name = path.file_name().unwrap_or_default().to_owned();
    tmp_name.push(format!(".tmp.{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let write = || -> std::io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        // The rename is durable only once the directory entry is.
        File::open(dir)?.sync_all()
    };
    write().map_err(|source| {
        let _ = fs::remove_file(&tmp);
        io_err("writing", what, path)(source)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    struct Change {
        tid: u32,
        original: i32,
    }

    impl Keyed for Change {
        fn tid(&self) -> u32 {
            self.tid
        }
    }

    const FORMAT: Format<Change> = Format {
        version: 1,
        what: "test ledger",
        legacy: None,
    };

    #[test]
    fn entries_survive_a_reopen_and_no_temp_file_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/ledger.json");
        let mut l = Ledger::open(&path, &FORMAT).unwrap();
        l.insert(Change {
            tid: 1,
            original: 3,
        })
        .unwrap();
        l.insert(Change {
            tid: 2,
            original: 4,
        })
        .unwrap();
        l.remove(2).unwrap();
        drop(l);
        let l = Ledger::open(&path, &FORMAT).unwrap();
        assert_eq!(
            l.entries().cloned().collect::<Vec<_>>(),
            [Change {
                tid: 1,
                original: 3
            }]
        );
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["ledger.json"]);
    }

    #[test]
    fn a_thread_named_twice_is_read_once_with_its_first_entry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.json");
        fs::write(
            &path,
            r#"{"version":1,"entries":[{"tid":7,"original":1},{"tid":8,"original":2},{"tid":7,"original":9}]}"#,
        )
        .unwrap();
        let first = [
            Change {
                tid: 7,
                original: 1,
            },
            Change {
                tid: 8,
                original: 2,
            },
        ];
        assert_eq!(
            Ledger::<Change>::previous(&path, &FORMAT).unwrap().unwrap(),
            first
        );
        let l = Ledger::open(&path, &FORMAT).unwrap();
        assert_eq!(l.entries().cloned().collect::<Vec<_>>(), first);
    }

    #[test]
    fn a_change_that_cannot_be_written_is_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = Ledger::fresh(dir.path().join("gone/ledger.json"), &FORMAT);
        assert!(l
            .insert(Change {
                tid: 1,
                original: 0
            })
            .is_err());
        assert!(l.is_empty(), "memory holds a record the file lacks");
        fs::create_dir(dir.path().join("gone")).unwrap();
        l.insert(Change {
            tid: 1,
            original: 0,
        })
        .unwrap();
        assert_eq!(l.len(), 1);
    }

    #[test]
    fn corrupt_files_are_kept_aside_and_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.json");
        fs::write(&path, "{ nope").unwrap();
        let err = Ledger::open(&path, &FORMAT).unwrap_err();
        assert!(err.to_string().contains("test ledger"), "{err}");
        assert!(matches!(err, LedgerError::Corrupt { .. }));
        fs::write(&path, r#"{"version":9,"entries":[]}"#).unwrap();
        let err = Ledger::<Change>::previous(&path, &FORMAT).unwrap_err();
        assert!(
            err.to_string().contains("unknown format version 9"),
            "{err}"
        );
        assert_eq!(
            fs::read_to_string(path.with_extension("json.corrupt")).unwrap(),
            "{ nope"
        );
        assert!(path.with_extension("json.corrupt.1").exists());
    }

    #[test]
    fn an_older_layout_is_read_through_its_reader() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.json");
        fs::write(&path, r#"{"7": 5}"#).unwrap();
        let format = Format {
            legacy: Some(|b: &[u8]| {
                let m: BTreeMap<u32, i32> = serde_json::from_slice(b).ok()?;
                Some(
                    m.into_iter()
                        .map(|(tid, original)| Change { tid, original })
                        .collect(),
                )
            }),
            ..FORMAT
        };
        let prev = Ledger::previous(&path, &format).unwrap().unwrap();
        assert_eq!(
            prev,
            [Change {
                tid: 7,
                original: 5
            }]
        );
        assert!(Ledger::<Change>::previous(dir.path().join("none"), &format)
            .unwrap()
            .is_none());
    }
}
