"""Images in requests: the one internal image part every dialect fills (``parts``), the fetcher
that brings remote and local images in safely (``fetch``) and the decoder with its caps
(``image``). Nothing here is imported until a request carries an image."""
