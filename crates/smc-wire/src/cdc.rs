//! CDC messages (placeholder; being written).
