"""The instructor's side of the workbook: the answer key, the student release and the grader.

Not part of the installed ``helpers`` package (``pyproject.toml`` lists only ``helpers.*``), so a
course's students, who get ``make release``'s notebooks and the installed package, get no answers.
See docs/INSTRUCTORS.md.
"""
