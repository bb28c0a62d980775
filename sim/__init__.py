"""The fleet simulator (``gpuwarden sim``) and the evaluator that scores decisions (``gpuwarden eval``)."""
