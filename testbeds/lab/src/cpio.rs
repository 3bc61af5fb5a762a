//! A `newc` cpio writer: all an initramfs needs (directories, regular files, symlinks),
//! so building the guest image needs no cpio binary on the host.

use std::io::Write;

pub struct Archive<W: Write> {
    out: W,
    ino: u32,
    written: u64,
}

const DIR: u32 = 0o040000;
const FILE: u32 = 0o100000;
const LINK: u32 = 0o120000;

impl<W: Write> Archive<W> {
    pub fn new(out: W) -> Self {
        Archive {
            out,
            ino: 1,
            written: 0,
        }
    }

    pub fn dir(&mut self, path: &str) -> std::io::Result<()> {
        self.entry(path, DIR | 0o755, b"")
    }

    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> std::io::Result<()> {
        self.entry(path, FILE | (mode & 0o7777), data)
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> std::io::Result<()> {
        self.entry(path, LINK | 0o777, target.as_bytes())
    }

    /// Writes the trailer and returns the sink.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.ino = 0;
        self.entry("TRAILER!!!", 0, b"")?;
        Ok(self.out)
    }

    fn entry(&mut self, path: &str, mode: u32, data: &[u8]) -> std::io::Result<()> {
        let name = path.trim_start_matches('/');
        let nlink = if mode & DIR == DIR { 2 } else { 1 };
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime: reproducible images
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0, // checksum (newc: none)
        );
        self.ino += 1;
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> std::io::Result<()> {
        let n = (4 - self.written % 4) % 4;
        self.put(&[0u8; 3][..n as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_four_byte_aligned_and_end_with_the_trailer() {
        let mut a = Archive::new(Vec::new());
        a.dir("/bin").unwrap();
        a.file("/bin/x", 0o755, b"hello").unwrap();
        a.symlink("/bin/y", "x").unwrap();
        let out = a.finish().unwrap();
        assert_eq!(out.len() % 4, 0);
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("070701"));
        // Header (110 bytes) + "bin\0" (4) = 114, padded to 116: the next header is there.
        assert_eq!(&out[116..122], b"070701");
        assert!(text.contains("bin/x\0"));
        assert!(text.contains("hello"));
        assert!(text.contains("TRAILER!!!"));
        // The file entry's size field (7th field) is 5.
        let at = text.find("bin/x").unwrap() - 110;
        assert_eq!(&text[at + 6 + 6 * 8..at + 6 + 7 * 8], "00000005");
    }
}
