//! Fuzz entry points (placeholder; being written).
