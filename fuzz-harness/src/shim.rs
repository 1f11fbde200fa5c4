//! Target `shim` (being written).
