"""Worker groups, placement (local or Ray), weight sync and resharding."""
