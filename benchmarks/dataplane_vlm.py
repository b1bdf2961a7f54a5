"""Data-plane benchmark with images: a 1-megapixel image per sample, at growing batch sizes.

    python benchmarks/dataplane_vlm.py --workers 4 --batch 8 16 32 64 --megapixels 1
    python benchmarks/dataplane_vlm.py --help
"""

from distflow.benchmarks.dataplane_vlm import main

# The guard matters: the coordinator's workers are spawned processes, which re-import
# the main script; without it each would start the benchmark again.
if __name__ == "__main__":
    raise SystemExit(main())
