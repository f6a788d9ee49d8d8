//! LLC messages (placeholder; being written).
