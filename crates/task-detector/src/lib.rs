//! Block-I/O accounting and I/O-bound classification (filled in by the task-detector work).
