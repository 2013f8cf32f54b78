"""The paper's baselines behind the same `TileQuantizer` interface; each module registers its presets."""
