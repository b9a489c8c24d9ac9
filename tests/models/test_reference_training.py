"""The reference-model training bar says which model is being trained (a newcomer sees 'training vit_digits', not
'train dense: 80/80')."""
from __future__ import annotations

from tasks.data import load_digits
from tasks.models import MODELS, TrainRecipe
from tasks.models.reference import _build_resnet, train_classifier


def test_training_bar_names_the_model(capsys):
    data = load_digits(0)
    model = _build_resnet(MODELS.get("resnet_digits").arch)
    recipe = TrainRecipe(epochs=1, lr=1e-3, weight_decay=0.0, batch_size=512, max_shift=0)
    train_classifier(model, data, recipe, seed=0, progress=True, name="resnet_digits")
    assert "training resnet_digits" in capsys.readouterr().err
