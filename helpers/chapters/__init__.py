"""Layer 4, chapters: one folder per chapter (ch00 ... ch07), its ``__init__`` the one chapter interface
(helpers/ui/chapter.py), the modules beside it that chapter's own experiments; ``_template`` is what a new
chapter's ``__init__`` is copied from. A chapter never imports another (docs/CONTRIBUTING.md maps the folders)."""
