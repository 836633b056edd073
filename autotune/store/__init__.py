"""The store: Optuna storages opened and checked, the record each trial keeps, and Optuna's private names
behind one door."""
