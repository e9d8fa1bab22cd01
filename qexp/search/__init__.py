"""`python -m qexp.search -m`: a multi-objective mixed-precision search by Hydra's Optuna sweeper (NSGA-II).

Modules: space (the search space and its seed trials: the sweeper's custom_search_space), trial (one recipe
measured on the selection windows, in memory across trials), run (a trial as a tracked MLflow child run), front
(the Pareto front at the end of the sweep: recipes, table, plot on the parent run), __main__ (the Hydra app).
"""
