//! Line framing with a hard cap: bytes in, complete lines out. A line longer than
//! `MAX_LINE` is dropped whole (reported once) and reading resumes after its newline, so
//! a hostile or broken peer can neither grow our buffer nor desynchronise the stream.

use crate::FrameError;

pub const MAX_LINE: usize = 64 * 1024;

#[derive(Debug, Default)]
pub struct LineReader {
    buf: Vec<u8>,
    discarding: bool,
}

impl LineReader {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns every line completed by them (without `\n` or `\r\n`), in
    /// order, or `TooLong` in place of an over-long one. Empty lines are skipped.
    pub fn push(&mut self, mut bytes: &[u8]) -> Vec<Result<Vec<u8>, FrameError>> {
        let mut out = Vec::new();
        while let Some(nl) = bytes.iter().position(|&b| b == b'\n') {
            let (head, rest) = bytes.split_at(nl);
            bytes = &rest[1..];
            if self.discarding || self.buf.len() + head.len() > MAX_LINE {
                self.discarding = false;
                self.buf.clear();
                out.push(Err(FrameError::TooLong));
                continue;
            }
            self.buf.extend_from_slice(head);
            let mut line = std::mem::take(&mut self.buf);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            if !line.is_empty() {
                out.push(Ok(line));
            }
        }
        if !self.discarding {
            if self.buf.len() + bytes.len() > MAX_LINE {
                self.discarding = true;
                self.buf.clear();
            } else {
                self.buf.extend_from_slice(bytes);
            }
        }
        out
    }

    /// Bytes held for an incomplete line.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_lines_across_chunks() {
        let mut r = LineReader::new();
        assert!(r.push(b"{\"a\":").is_empty());
        let out = r.push(b"1}\n\n{\"b\":2}\r\n{\"c\"");
        assert_eq!(
            out,
            vec![Ok(b"{\"a\":1}".to_vec()), Ok(b"{\"b\":2}".to_vec())]
        );
        assert_eq!(r.pending(), 4);
    }

    #[test]
    fn an_oversized_line_is_dropped_and_the_stream_resyncs() {
        let mut r = LineReader::new();
        let big = vec![b'x'; MAX_LINE + 10];
        assert!(r.push(&big).is_empty());
        assert_eq!(r.pending(), 0, "the buffer must not grow past the cap");
        let out = r.push(b"yyy\n{\"ok\":1}\n");
        assert_eq!(
            out,
            vec![Err(FrameError::TooLong), Ok(b"{\"ok\":1}".to_vec())]
        );
        // Exactly at the cap is fine.
        let mut exact = vec![b'z'; MAX_LINE];
        exact.push(b'\n');
        assert_eq!(r.push(&exact), vec![Ok(vec![b'z'; MAX_LINE])]);
    }
}
