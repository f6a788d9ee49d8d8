//! CLC messages (placeholder; being written).
