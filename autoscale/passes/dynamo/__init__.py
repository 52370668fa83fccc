"""The Dynamo-stage passes: they rewrite Dynamo's torch-level graph, before autograd, deciding what is
computed in which dtype and where the gradient-scaling points and the forward's checks go."""
