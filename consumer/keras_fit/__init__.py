"""The model.fit path: the Keras callback and cast layer, the check of a user's compiled model, and
KerasTrainer.
"""
