"""Worker groups, placement (local or Ray), weight sync and resharding."""

# loopline.config imports this package's config sections (cluster, placement), which build on its
# Section: load it first, so that importing a runtime module on its own finds Section defined.
import loopline.config  # noqa: F401
