"""Layer 3, pipeline: what two or more chapters use of the data pipeline, and what workers import by name (data
sets, collate and init functions). Imports core and ui; each chapter's own experiments are in helpers/chapters/chNN/.
docs/CONTRIBUTING.md's Layers section lists the modules and what each holds.
"""
