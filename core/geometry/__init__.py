"""Pure region math: boxes, flat ranges, chunk grids; regular (DTensor) layouts; placements as index runs."""
