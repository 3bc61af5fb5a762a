//! Real-kernel tests: detector (being written).
