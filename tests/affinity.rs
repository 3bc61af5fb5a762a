//! Real-kernel tests: affinity (being written).
