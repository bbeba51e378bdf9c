"""Layer 1, core: settings, argument checks, device facts, timers, result files and evidence. Imports nothing
above it; every other layer may import it (docs/CONTRIBUTING.md maps the modules)."""
