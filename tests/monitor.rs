//! Real-kernel tests: monitor (being written).
