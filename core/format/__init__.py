"""The on-disk contract: metadata records and their JSON (versioned, validated), grid tensors, checksum tables, the safe codec of plain values."""
