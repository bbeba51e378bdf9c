"""Layer 4, chapters: one module per chapter, and what puts the pipeline together. Imports every layer below.

chNN        chapter NN's module (ch00 ... ch07), the one chapter interface (helpers/ui/chapter.py):
            its live panel (controls, run, summary, plot), its headless benchmark, and the
            chapter's own displays (e.g. ch02: the GPU copy curves, measured or recorded)
_template   the template a new chapter module is copied from
capstone    chapter 06: every step stacked on one job, in two regimes
doctor      chapter 06: diagnose any pipeline (data-, transfer- or compute-bound)
distributed chapter 07: DistributedSampler demos and the torchrun launcher
ddp_train   chapter 07: the per-rank training script torchrun runs
"""
