"""Layer 4, chapters: what puts the pipeline together. Imports every layer below.

ch02        chapter 02: pageable vs pinned copies (its panel, GPU curves, benchmark)
capstone    chapter 06: every step stacked on one job, in two regimes
doctor      chapter 06: diagnose any pipeline (data-, transfer- or compute-bound)
distributed chapter 07: DistributedSampler demos and the torchrun launcher
ddp_train   chapter 07: the per-rank training script torchrun runs
"""
