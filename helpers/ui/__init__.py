"""Layer 2, ui: what the reader sees (plots, the live panel, exercise checks, the pipeline cells' diffs, published
figures). Imports core only; docs/CONTRIBUTING.md maps the modules."""
