"""Layer 4, chapters: one folder per chapter, and what puts the pipeline together. Imports every layer below.

chNN/       chapter NN's folder (ch00 ... ch07): its ``__init__`` is the one chapter interface
            (helpers/ui/chapter.py: the live panel's controls, run, summary and plot, and the headless
            benchmark); the modules beside it are that chapter's own experiments:
            ch00/hygiene                    warm-up, synchronisation and clock experiments
            ch01/anatomy, training          the reader's step timed phase by phase; evaluation
            ch02/copies, model, pin_costs, figures   the copy sweep and timed copies; fit and pin limit;
                                            what pinning costs; the plots
            ch03/pinning                    the pin thread; pinned against pageable in alternating rounds
            ch04/sweeps, speedup, pitfalls  the worker sweep and knobs; the fair speed-up figure; pitfalls
            ch05/overlap, hazards, feeding, gpudecode   the 2x2 overlap; async hazards; pipeline timing; JPEG decode
            ch06/job, run, calibration, capstone   the job and its loader; one configuration's run; the regimes;
                                            every step stacked on one job (the waterfall)
            ch06/doctor, diagnosis, fast_pipeline  the doctor's measurement; its decision; the chapter's cells
            ch07/distributed, torchrun, ddp_train   sampler demos and the launcher; torchrun on loopback; the rank
_template   the template a new chapter folder's ``__init__`` is copied from

A chapter never imports another chapter's folder: what two chapters share lives in a lower layer.
"""
