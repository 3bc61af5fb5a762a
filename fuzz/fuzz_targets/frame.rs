//! Guest bytes as the host reads them: framing in arbitrary chunks, then message parsing.
//! No input may panic, a line never exceeds the cap, and whatever parses survives its own
//! encoding unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proto::{LineReader, Message, MAX_LINE};

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, bytes)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(chunk).max(1);
    let mut reader = LineReader::new();
    for piece in bytes.chunks(chunk) {
        for line in reader.push(piece) {
            let Ok(line) = line else { continue };
            assert!(line.len() <= MAX_LINE);
            if let Ok(msg) = Message::parse(&line) {
                let again = Message::parse(msg.to_line().trim_end().as_bytes())
                    .expect("an encoded message parses");
                assert_eq!(again, msg);
            }
        }
        assert!(reader.pending() <= MAX_LINE);
    }
});
