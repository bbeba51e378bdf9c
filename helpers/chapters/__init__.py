"""Layer 4, chapters: one module per chapter, and what puts the pipeline together. Imports every layer below.

    chNN        chapter NN's module (ch00 ... ch07): the one chapter interface (helpers/ui/chapter.py):
                its live panel (controls, run, summary, plot) and its headless benchmark
    _template   the template a new chapter module is copied from

ch02        chapter 02: pageable vs pinned copies (its panel, GPU curves, benchmark)
capstone    chapter 06: every step stacked on one job, in two regimes
doctor      chapter 06: diagnose any pipeline (data-, transfer- or compute-bound)
distributed chapter 07: DistributedSampler demos and the torchrun launcher
ddp_train   chapter 07: the per-rank training script torchrun runs
"""
