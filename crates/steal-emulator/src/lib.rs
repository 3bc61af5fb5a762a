//! Steal emulator (filled in).
